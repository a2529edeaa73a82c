"""Issue 18: the same checkpoint through exllamav3's own dynamic generator (what TabbyAPI runs).

    source ci/exllamav3-env.sh        # on the GPU machine: exllamav3 1.6.5 with its prebuilt extension
    python3 bench/exllamav3_generator.py MODEL_DIR --out FILE.json [--concurrency 1,2,...,256]
        [--prompt 512 --output 256] [--deadline SECONDS]
    python3 bench/exllamav3_generator.py MODEL_DIR --serve [--concurrency ...]   # bench/same_run.py's variant

At each concurrency N, N jobs of ``--prompt`` random token ids (seeded per level, ``level_seed``: the ids
serving_http.py sends at that level, none seen at another level) and ``--output`` new tokens each, greedy
(ArgmaxSampler), no stop conditions (ignore EOS), are enqueued at once into one Generator (max_batch_size = the
largest N, a cache of N x (prompt + output) tokens and N recurrent slots), and iterated to the end. Per N, by
serving_http.py's formula (run_level): wall time, decode throughput, per-request speed and time to first token, each
token timed when ``iterate()`` hands it over; exllamav3's own job times beside them (``exl3_*``). exllamav3's
``Model.warmup`` runs after loading, as its model_init.py does, then one warm-up job. Results are written after
every N. With ``--serve`` the levels are asked on stdin instead (serve()), one at a time, by bench/same_run.py,
which alternates them with aphrodite's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """N prompts of random ids, the same for one seed in every driver (bench/serving_http.py imports this)."""
    import random

    rng = random.Random(seed)
    # ids 1000.. avoid the special and added tokens at the start of Qwen-family vocabularies
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(n)]


def level_seed(concurrency: int, repeat: int = 0) -> int:
    """The prompts' seed of one measured level: its own for every (concurrency, repeat), the same for every engine.

    A prompt sent twice is answered from cache in part: aphrodite 0.23.0+ cache prefixes of hybrid models by
    default (in whole attention blocks, so a bfloat16 state's 400-token block hits on a 512-token prompt where a
    float32 state's 784-token block does not), and exllamav3's dynamic generator can reuse the cached pages of a
    prompt it has seen. Fresh prompts per level keep the cache out of every measured level; the warm-up seeds (98,
    99) are apart.
    """
    return 1_000_000 + 1_000 * repeat + concurrency


def run_level(generator, Job, sampler, ids: list[list[int]], output: int, torch) -> dict:
    """One level: every job enqueued at once, iterated to the end. The figures are serving_http.level's, by the same
    formula (bench/same_run.py compares the two engines on them): decode tok/s = completed x (output - 1) / (the last
    token of any job - the first token of any job), per-request tok/s = mean of (output - 1) / (its last token - its
    first token), each token's time the moment ``iterate()`` handed it over. exllamav3's own job times are kept
    beside them (``exl3_*``: generator/job.py's durations, time_generate = last token - first token)."""
    jobs = [
        Job(input_ids=torch.tensor([p]), max_new_tokens=output, sampler=sampler, stop_conditions=[], identifier=i)
        for i, p in enumerate(ids)
    ]
    start = time.perf_counter()
    for job in jobs:
        generator.enqueue(job)
    done, new_tokens, first, last = {}, 0, {}, {}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r.get("stage") != "streaming":
                continue
            now = time.perf_counter()
            first.setdefault(r["identifier"], now)
            last[r["identifier"]] = now
            if r.get("eos"):
                done[r["identifier"]] = r
                new_tokens += r.get("new_tokens", 0)
    wall = time.perf_counter() - start
    ttft = [first[i] - start for i in done]
    span = max(last[i] for i in done) - min(first[i] for i in done) if done else 0
    decode = [(output - 1) / (last[i] - first[i]) for i in done if last[i] > first[i]]
    exl3_ttft = [r["time_enqueued"] + r["time_prefill"] for r in done.values()]
    exl3_per_request = [
        (r["new_tokens"] - 1) / r["time_generate"] for r in done.values() if r.get("time_generate", 0) > 0
    ]
    exl3_decode_wall = wall - max(exl3_ttft) if exl3_ttft else wall
    return {
        "concurrency": len(ids),
        "completed": len(done),
        "failed": len(ids) - len(done),
        "new_tokens": new_tokens,
        "wall_s": round(wall, 3),
        "throughput_tok_s": round(len(done) * output / wall, 1) if wall else None,
        "decode_tok_s": round(len(done) * (output - 1) / span, 1) if span else None,
        "per_request_tok_s": round(statistics.mean(decode), 1) if decode else None,
        "ttft_mean_s": round(statistics.mean(ttft), 3) if ttft else None,
        "ttft_max_s": round(max(ttft), 3) if ttft else None,
        # exllamav3's own formula, which bench/results/fulldepth.md's exllamav3 rows used: N x output / (wall - the
        # slowest first token); it counts the tokens made before the slowest first token without their time
        "exl3_decode_tok_s": round(new_tokens / exl3_decode_wall, 1) if exl3_decode_wall > 0 else None,
        "exl3_per_request_tok_s": round(statistics.mean(exl3_per_request), 1) if exl3_per_request else None,
        "exl3_ttft_mean_s": round(statistics.mean(exl3_ttft), 3) if exl3_ttft else None,
    }


def serve(generator, Job, sampler, vocab: int, prompt: int, torch, stdin=sys.stdin, stdout=sys.stdout) -> None:
    """bench/same_run.py's exllamav3 variant: one JSON object per stdin line, ``{"concurrency": N, "seed": S,
    "output": O}``, answered by one ``LEVEL {row}`` line (run_level's row, on the prompts ``prompts(N, prompt, vocab,
    seed=S)``, the ids an aphrodite variant gets for that seed); a line that is not such an object gets ``ERROR
    {...}`` and the loop goes on. Ends at end of input."""
    for line in stdin:
        try:
            ask = json.loads(line)
            n, seed, output = int(ask["concurrency"]), int(ask["seed"]), int(ask["output"])
            if n < 1 or output < 2:
                raise ValueError("concurrency >= 1 and output >= 2")
        except (ValueError, KeyError, TypeError) as e:
            print(
                "ERROR " + json.dumps({"error": f"{type(e).__name__}: {e}", "line": line[:200]}),
                file=stdout,
                flush=True,
            )
            continue
        row = run_level(generator, Job, sampler, prompts(n, prompt, vocab, seed=seed), output, torch)
        print("LEVEL " + json.dumps(row), file=stdout, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--out", type=Path, help="the results file (required without --serve)")
    parser.add_argument(
        "--serve",
        action="store_true",
        help="after loading and warming up, print READY {...} and measure the levels asked on stdin (serve()); "
        "--concurrency then only sizes the cache and the batch (its largest value)",
    )
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--deadline", type=float, default=1e9, help="start no level after this many seconds")
    args = parser.parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"{args.model_dir} has no config.json")
    if args.out is None and not args.serve:
        parser.error("give --out FILE (or --serve)")
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency takes a comma list of integers, not {args.concurrency!r}")
    t0 = time.monotonic()
    import torch
    from exllamav3 import Cache, Config, Generator, Job, Model, Tokenizer
    from exllamav3.generator.sampler import ArgmaxSampler

    config = Config.from_directory(str(args.model_dir))
    model = Model.from_config(config)
    top = max(levels)
    cache = Cache(model, max_num_tokens=top * (args.prompt + args.output) + 256, max_batch_size=top)
    load_start = time.perf_counter()
    model.load(device="cuda:0")
    load_s = time.perf_counter() - load_start
    # exllamav3's own first-use costs (Triton compilation and autotuning, the GEMM autotuner per row
    # count up to 64, the graph-captured decode workspaces), paid before a generator is attached, as
    # its model_init.py does for every model it loads (run 12 had no warm-up: its N = 2 level was slower
    # than N = 1, the autotuner's cost inside the measurement)
    warm_start = time.perf_counter()
    warm_failed = model.warmup(cache=cache, max_batch_size=min(top, 8))
    warmup_s = time.perf_counter() - warm_start
    tokenizer = Tokenizer.from_config(config)
    generator = Generator(model=model, cache=cache, tokenizer=tokenizer, max_batch_size=top)
    sampler = ArgmaxSampler()
    vocab = json.loads((args.model_dir / "config.json").read_text()).get("text_config", {}).get("vocab_size", 32000)
    out = {"model": str(args.model_dir), "prompt": args.prompt, "output": args.output, "load_s": round(load_s, 1)}
    out.update(warmup_s=round(warmup_s, 1), warmup_failed=list(warm_failed or []))
    out["warmup"] = run_level(generator, Job, sampler, prompts(1, args.prompt, vocab, seed=99), 16, torch)
    if args.serve:
        # the largest batch once, as same_run.py warms every aphrodite variant, so that no level pays a first use
        out["warmup_top"] = run_level(generator, Job, sampler, prompts(top, args.prompt, vocab, seed=98), 16, torch)
        print("READY " + json.dumps(out), flush=True)
        serve(generator, Job, sampler, vocab, args.prompt, torch)
        return 0
    out["rows"] = []
    for n in levels:
        if time.monotonic() - t0 > args.deadline:
            out["stopped_before"] = n
            break
        out["rows"].append(
            run_level(generator, Job, sampler, prompts(n, args.prompt, vocab, seed=level_seed(n)), args.output, torch)
        )
        args.out.write_text(json.dumps(out, indent=2))
        print(json.dumps(out["rows"][-1]), flush=True)
    args.out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
