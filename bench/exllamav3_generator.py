"""The same checkpoint through exllamav3's own dynamic generator (what TabbyAPI runs).

    source ci/exllamav3-env.sh        # on the GPU machine: exllamav3 1.6.5 with its prebuilt extension
    python3 bench/exllamav3_generator.py MODEL_DIR --out FILE.json [--concurrency 1,2,...,256]
        [--prompt 512 --output 256] [--state-dtype float16|float32] [--deadline SECONDS] [--mtp K]
    python3 bench/exllamav3_generator.py MODEL_DIR --serve [--concurrency ...]   # bench/same_run.py's variant

At each concurrency N, N jobs of ``--prompt`` random token ids (seeded per level, ``level_seed``: the ids
serving_http.py sends at that level, none seen at another level) and ``--output`` new tokens each, greedy
(ArgmaxSampler), no stop conditions (ignore EOS), are enqueued at once into one Generator and iterated to the end.
The generator's batch is the largest N, and its cache holds every job of that batch at once (:func:`cache_tokens`);
each level records how many jobs the generator had active at most (``active_jobs``) beside how many streamed at once
(``active``), so that a level whose jobs waited for one another is seen, not assumed away. The GDN recurrent state
is stored in ``--state-dtype`` (exllamav3's ``Cache(recurrent_dtype=...)``: float16 by default, float32 the
published config's width, which aphrodite serves by default). Per N: level_figures.figures by the one formula,
each token timed when ``iterate()`` hands it over; exllamav3's own job times beside them (``exl3_*``).
exllamav3's ``Model.warmup`` runs after loading, as its model_init.py does, then one warm-up job. Results are
written after every N. With ``--serve`` the levels are asked on stdin instead (serve()), one at a time, by
bench/same_run.py, which alternates them with aphrodite's.

With ``--mtp K`` the checkpoint's MTP head is loaded as the draft model, as exllamav3's model_init.py ``--mtp`` loads
it (``Model.from_config(config, component="mtp")``, a draft cache of the same size, ``max_history`` max(4, K)), and
the generator is built for K draft tokens; each level then drafts ``draft`` tokens a step (0 to K: the generator's
``num_draft_tokens``, 0 its regular generation with the head loaded but not drafting). Each row keeps the
generator's own accepted and rejected draft tokens (generator/job.py, at EOS) and ``draft_acceptance``, accepted /
(accepted + rejected).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from level_figures import figures, level_seed, prompts  # noqa: E402  (the drivers' one source and formula)

# exllamav3 1.6.5 (constants.py PAGE_SIZE): the cache is allocated in pages of 256 tokens
PAGE_SIZE = 256
STATE_DTYPES = ("float16", "float32")


def pages_per_job(prompt: int, output: int, draft: int = 0) -> int:
    """The pages one job of ``prompt`` tokens and ``output`` new tokens reserves when it starts, as exllamav3 1.6.5
    counts them: the budget ``max_rq_tokens = max_new_tokens + 1 + max_draft_tokens`` (generator/job.py) and
    ``ceil((len(sequence_ids) + budget) / PAGE_SIZE)`` pages (generator/pagetable.py ``Sequence.prepare``). A job
    starts only once all of them are free, so a cache of fewer than N x this many pages holds the others back."""
    return -(-(prompt + output + 1 + draft) // PAGE_SIZE)


def cache_tokens(top: int, prompt: int, output: int, draft: int = 0) -> int:
    """Cache size (tokens, whole pages) that lets ``top`` such jobs be active at once, with one spare page."""
    return (top * pages_per_job(prompt, output, draft) + 1) * PAGE_SIZE


def draft_figures(done: list[dict]) -> dict:
    """The generator's own draft counts over a level's jobs (generator/job.py's EOS result)."""
    accepted = sum(r.get("accepted_draft_tokens", 0) for r in done)
    rejected = sum(r.get("rejected_draft_tokens", 0) for r in done)
    if not accepted + rejected:
        return {}
    acceptance = round(accepted / (accepted + rejected), 4)
    return {"draft_accepted": accepted, "draft_rejected": rejected, "draft_acceptance": acceptance}


def run_level(generator, Job, sampler, ids: list[list[int]], output: int, torch) -> dict:
    """One level: every job enqueued at once, iterated to the end. The figures are serving_http.level's, by the same
    formula (level_figures.figures), each token's time the moment ``iterate()`` handed it over; ``active_jobs`` is
    the most jobs the generator held active after any iteration, ``t_start``/``t_end`` the level's wall-clock window.
    exllamav3's own job times are kept beside them (``exl3_*``: generator/job.py's durations, time_generate = last
    token - first token)."""
    jobs = [
        Job(input_ids=torch.tensor([p]), max_new_tokens=output, sampler=sampler, stop_conditions=[], identifier=i)
        for i, p in enumerate(ids)
    ]
    t_start = time.time()
    start = time.perf_counter()
    for job in jobs:
        generator.enqueue(job)
    done, new_tokens, first, last, chunks, active_jobs = {}, 0, {}, {}, {}, 0
    while generator.num_remaining_jobs():
        results = generator.iterate()
        active_jobs = max(active_jobs, len(generator.active_jobs))
        for r in results:
            if r.get("stage") != "streaming":
                continue
            now = time.perf_counter()
            first.setdefault(r["identifier"], now)
            last[r["identifier"]] = now
            chunks[r["identifier"]] = chunks.get(r["identifier"], 0) + 1
            if r.get("eos"):
                done[r["identifier"]] = r
                new_tokens += r.get("new_tokens", 0)
    wall = time.perf_counter() - start
    row = figures(len(ids), output, [first[i] - start for i in done], [(first[i], last[i]) for i in done], wall)
    exl3_ttft = [r["time_enqueued"] + r["time_prefill"] for r in done.values()]
    exl3_per_request = [
        (r["new_tokens"] - 1) / r["time_generate"] for r in done.values() if r.get("time_generate", 0) > 0
    ]
    exl3_decode_wall = wall - max(exl3_ttft) if exl3_ttft else wall
    row.update(
        new_tokens=new_tokens,
        active_jobs=active_jobs,
        t_start=round(t_start, 3),
        t_end=round(t_start + wall, 3),
        # tokens per job as exllamav3 counted them at EOS (a streamed result may carry several tokens)
        tokens_min=min((r.get("new_tokens", 0) for r in done.values()), default=0),
        tokens_max=max((r.get("new_tokens", 0) for r in done.values()), default=0),
        # exllamav3's own formula, which bench/results/fulldepth.md's exllamav3 rows used: N x output / (wall - the
        # slowest first token); it counts the tokens made before the slowest first token without their time
        exl3_decode_tok_s=round(new_tokens / exl3_decode_wall, 1) if exl3_decode_wall > 0 else None,
        exl3_per_request_tok_s=round(statistics.mean(exl3_per_request), 1) if exl3_per_request else None,
        exl3_ttft_mean_s=round(statistics.mean(exl3_ttft), 3) if exl3_ttft else None,
        **draft_figures(list(done.values())),
    )
    return row


def serve(generator, Job, sampler, vocab: int, prompt: int, torch, stdin=sys.stdin, stdout=sys.stdout) -> None:
    """bench/same_run.py's exllamav3 variant: one JSON object per stdin line, ``{"concurrency": N, "seed": S,
    "output": O}``, answered by one ``LEVEL {row}`` line (run_level's row, on the prompts ``prompts(N, prompt, vocab,
    seed=S)``, the ids an aphrodite variant gets for that seed); a line that is not such an object gets ``ERROR
    {...}`` and the loop goes on. Ends at end of input."""
    for line in stdin:
        try:
            ask = json.loads(line)
            n, seed, output = int(ask["concurrency"]), int(ask["seed"]), int(ask["output"])
            draft, pool = int(ask.get("draft", 0)), ask.get("pool")
            if n < 1 or output < 2:
                raise ValueError("concurrency >= 1 and output >= 2")
            most = getattr(generator, "max_draft_tokens", 0)
            if not 0 <= draft <= most:
                raise ValueError(f"draft {draft}: this generator drafts 0 to {most}")
            pool = None if pool is None else (int(pool[0]), int(pool[1]))
        except (ValueError, KeyError, TypeError) as e:
            print(
                "ERROR " + json.dumps({"error": f"{type(e).__name__}: {e}", "line": line[:200]}),
                file=stdout,
                flush=True,
            )
            continue
        if hasattr(generator, "num_draft_tokens"):
            generator.num_draft_tokens = draft  # the draft window of every round (generator.py iterate)
        row = run_level(generator, Job, sampler, prompts(n, prompt, vocab, seed=seed, pool=pool), output, torch)
        if draft:
            row["draft_tokens"] = draft
        print("LEVEL " + json.dumps(row), file=stdout, flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--out", type=Path, help="the results file (required without --serve)")
    p.add_argument(
        "--serve",
        action="store_true",
        help="after loading and warming up, print READY {...} and measure the levels asked on stdin (serve()); "
        "--concurrency then only sizes the cache and the batch (its largest value)",
    )
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=256)
    p.add_argument(
        "--state-dtype",
        choices=STATE_DTYPES,
        default="float16",
        help="the GDN recurrent state's storage (exllamav3's Cache recurrent_dtype; its default float16)",
    )
    p.add_argument("--deadline", type=float, default=1e9, help="start no level after this many seconds")
    p.add_argument(
        "--mtp",
        type=int,
        default=0,
        metavar="K",
        help="load the MTP head as the draft model, the generator built for up to K draft tokens a step (--serve: "
        "each level asks for 0 to K)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        parser().error(f"{args.model_dir} has no config.json")
    if args.out is None and not args.serve:
        parser().error("give --out FILE (or --serve)")
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser().error(f"--concurrency takes a comma list of integers, not {args.concurrency!r}")
    t0 = time.monotonic()
    import torch
    from exllamav3 import Cache, Config, Generator, Job, Model, Tokenizer
    from exllamav3.generator.sampler import ArgmaxSampler

    if args.mtp < 0:
        parser().error("--mtp takes K >= 1 (0: no draft model)")
    config = Config.from_directory(str(args.model_dir))
    model = Model.from_config(config)
    top = max(levels)
    state = {"float16": torch.half, "float32": torch.float}[args.state_dtype]
    tokens = cache_tokens(top, args.prompt, args.output, args.mtp)
    # model_init.py: the speculative headroom of a recurrent model's cache, max(the head's default 4, K)
    history = max(4, args.mtp) if args.mtp else 0
    cache = Cache(model, max_num_tokens=tokens, max_batch_size=top, recurrent_dtype=state, max_history=history)
    draft_model = draft_cache = None
    load_start = time.perf_counter()
    if args.mtp:  # as model_init.py --mtp: the head as a component model, its cache the same size, loaded first
        draft_model = Model.from_config(config, component="mtp")
        draft_cache = Cache(
            draft_model, max_num_tokens=tokens, max_batch_size=top, recurrent_dtype=state, max_history=history
        )
        draft_model.load(device="cuda:0")
        model.load(device="cuda:0", draft_model=draft_model)
    else:
        model.load(device="cuda:0")
    load_s = time.perf_counter() - load_start
    # exllamav3's own first-use costs (Triton compilation and autotuning, the GEMM autotuner per row
    # count up to 64, the graph-captured decode workspaces), paid before a generator is attached, as
    # its model_init.py does for every model it loads
    warm_start = time.perf_counter()
    warm_failed = model.warmup(cache=cache, max_batch_size=min(top, 8))
    warmup_s = time.perf_counter() - warm_start
    tokenizer = Tokenizer.from_config(config)
    drafting = {}
    if args.mtp:
        drafting = {"draft_model": draft_model, "draft_cache": draft_cache, "num_draft_tokens": args.mtp}
    generator = Generator(model=model, cache=cache, tokenizer=tokenizer, max_batch_size=top, **drafting)
    sampler = ArgmaxSampler()
    vocab = json.loads((args.model_dir / "config.json").read_text()).get("text_config", {}).get("vocab_size", 32000)
    out = {"model": str(args.model_dir), "prompt": args.prompt, "output": args.output, "load_s": round(load_s, 1)}
    out.update(warmup_s=round(warmup_s, 1), warmup_failed=list(warm_failed or []))
    out.update(state_dtype=args.state_dtype, cache_tokens=tokens, max_batch_size=top, mtp=args.mtp)
    out["warmup"] = run_level(generator, Job, sampler, prompts(1, args.prompt, vocab, seed=99), 16, torch)
    if args.serve:
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
