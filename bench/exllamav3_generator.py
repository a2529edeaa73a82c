"""Issue 18: the same checkpoint through exllamav3's own dynamic generator (what TabbyAPI runs).

    source ci/exllamav3-env.sh        # on the GPU machine: exllamav3 1.6.5 with its prebuilt extension
    python3 bench/exllamav3_generator.py MODEL_DIR --out FILE.json [--concurrency 1,2,...,256]
        [--prompt 512 --output 256] [--deadline SECONDS]

At each concurrency N, N jobs of ``--prompt`` random token ids (seeded per level, ``level_seed``: the ids
serving_http.py sends at that level, none seen at another level) and ``--output`` new tokens each, greedy
(ArgmaxSampler), no stop conditions (ignore EOS), are enqueued at once into one Generator (max_batch_size = the
largest N, a cache of N x (prompt + output) tokens and N recurrent slots), and iterated to the end. Per N: wall
time, decode throughput (N x output / (wall - the slowest time to first token)), per-request speed ((output - 1) /
time_generate, mean over the jobs) and time to first token (queue wait plus exllamav3's own ``time_prefill``, mean
and max). exllamav3's ``Model.warmup`` runs after loading, as its model_init.py does, then one warm-up job. Results
are written after every N (resumable by --concurrency).
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    jobs = [
        Job(input_ids=torch.tensor([p]), max_new_tokens=output, sampler=sampler, stop_conditions=[], identifier=i)
        for i, p in enumerate(ids)
    ]
    start = time.perf_counter()
    for job in jobs:
        generator.enqueue(job)
    done, new_tokens = {}, 0
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r.get("stage") == "streaming" and r.get("eos"):
                done[r["identifier"]] = r
                new_tokens += r.get("new_tokens", 0)
    wall = time.perf_counter() - start
    ttft = [r["time_enqueued"] + r["time_prefill"] for r in done.values()]
    # exllamav3's job times are durations (generator/job.py: time_prefill = first token - first
    # prefill, time_generate = last token - first token), as serving_http.py's per-request figure
    per_request = [(r["new_tokens"] - 1) / r["time_generate"] for r in done.values() if r.get("time_generate", 0) > 0]
    decode_wall = wall - max(ttft) if ttft else wall
    return {
        "concurrency": len(ids),
        "completed": len(done),
        "new_tokens": new_tokens,
        "wall_s": round(wall, 3),
        "throughput_tok_s": round(new_tokens / wall, 1),
        "decode_tok_s": round(new_tokens / decode_wall, 1) if decode_wall > 0 else None,
        "per_request_tok_s": round(statistics.mean(per_request), 1) if per_request else None,
        "ttft_mean_s": round(statistics.mean(ttft), 3) if ttft else None,
        "ttft_max_s": round(max(ttft), 3) if ttft else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--deadline", type=float, default=1e9, help="start no level after this many seconds")
    args = parser.parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"{args.model_dir} has no config.json")
    levels = [int(c) for c in args.concurrency.split(",")]
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
