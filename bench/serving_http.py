"""Issue 18: serving speed as users reach it: `aphrodite run` (default compiled mode) and the openai client.

    python3 bench/serving_http.py MODEL_DIR --out FILE.json [--adapter PATH] [--concurrency 1,2,...,256]
        [--prompt 512 --output 256] [--engine-args "..."] [--deadline SECONDS]

Starts the real server (tests/gpu/server.py: the console script, the overlay found by aphrodite's
plugin loader) with the engine's defaults plus ``--engine-args`` (and, with ``--adapter``,
``--enable-lora --lora-modules bench=PATH``, every request then naming that adapter). At each
concurrency N: N streaming completions at once, ``--prompt`` random token ids each (seeded per level, the ids
exllamav3_generator.py sends there, none repeated from another level), greedy,
``--output`` tokens with ``ignore_eos``. Per N: wall time, throughput (N x output / wall), decode
throughput (tokens after each request's first over the span from the first first-token to the last
token), per-request decode speed (mean of (output - 1) / (last token - first token)) and time to first
token (mean, max). A warm-up request runs first. Results are written after every level.

Two engines measured in one run without a second start-up each on the critical path (a LoRA
cost): start both at once, each with ``--ready-file`` (touched once it has answered its warm-up, or has
failed to start) and ``--wait-for`` (the levels begin only once every named file exists, or after
``--wait-timeout``), e.g. base waits for the LoRA engine's ready file and the LoRA engine for the base's
``--done-file``. The engine that is not measuring is idle (its memory static, no requests), and the
JSON records how long each waited and what it still lacked when the wait ran out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
sys.path.insert(0, str(ROOT / "bench"))
from level_figures import figures, level_seed, prompts  # noqa: E402  (one prompt source and formula)


async def one(api, model: str, ids: list[int], output: int) -> dict:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    stream = await api.completions.create(
        model=model,
        prompt=ids,
        max_tokens=output,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "min_tokens": output},
    )
    made = None
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text is not None:
            first = first or now
            last = now
            tokens += 1
        if getattr(chunk, "usage", None) is not None:  # the last chunk: the tokens the engine made
            made = chunk.usage.completion_tokens
    return {"start": start, "first": first, "last": last, "chunks": tokens, "tokens": made}


async def level(url: str, model: str, ids: list[list[int]], output: int) -> dict:
    """One level: every prompt sent at once, streamed; level_figures.figures by the one formula, and beside them
    what bench/same_run.py checks before it reports the level: each request's streamed chunk count (one token a
    chunk: ``chunks_min`` == ``chunks_max`` == output, or the per-token times are not the tokens'; with speculative
    decoding a chunk holds every token of a step, and the engine's usage counts, ``tokens_min``/``tokens_max``, must
    be the output), the largest
    number streaming at once (``active``), and the level's wall-clock window (``t_start``, ``t_end``: epoch
    seconds, for matching the engine log's compile warnings)."""
    import openai

    api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    try:
        t_start = time.time()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(api, model, p, output) for p in ids), return_exceptions=True)
        wall = time.perf_counter() - t0
        t_end = time.time()
    finally:
        await api.close()
    ok = [r for r in results if isinstance(r, dict) and r["first"] is not None]
    failed = [repr(r)[:200] for r in results if not isinstance(r, dict)]
    row = figures(len(ids), output, [r["first"] - r["start"] for r in ok], [(r["first"], r["last"]) for r in ok], wall)
    row["first_failure"] = failed[:1]
    chunks = [r["chunks"] for r in ok]
    row.update(chunks_min=min(chunks, default=0), chunks_max=max(chunks, default=0))
    made = [r["tokens"] for r in ok if r.get("tokens") is not None]
    if made:  # the engine's own count (usage): a speculative step streams several tokens in one chunk
        row.update(tokens_min=min(made), tokens_max=max(made))
    row.update(t_start=round(t_start, 3), t_end=round(t_end, 3))
    return row


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--adapter", type=Path, help="a PEFT adapter folder: served as 'bench', every request uses it")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--engine-args", default="", help="extra `aphrodite run` arguments, one shell-quoted string")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--deadline", type=float, default=1e9, help="start no level after this many seconds")
    p.add_argument("--ready-file", type=Path, help="touched once the warm-up has answered (or the start failed)")
    p.add_argument("--done-file", type=Path, help="touched when this run ends, whatever the outcome")
    p.add_argument("--wait-for", type=Path, action="append", default=[], help="levels wait for this file")
    p.add_argument("--wait-timeout", type=float, default=1200, help="seconds to wait for --wait-for files")
    return p


def touch(path: Path | None) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def wait_for(paths: list[Path], timeout: float) -> dict:
    """Until every path exists or the timeout passes: how long it took, and what was still missing."""
    t0 = time.monotonic()
    while any(not p.exists() for p in paths) and time.monotonic() - t0 < timeout:
        time.sleep(2)
    return {"waited_s": round(time.monotonic() - t0, 1), "missing": [str(p) for p in paths if not p.exists()]}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        parser().error(f"{args.model_dir} has no config.json")
    if args.adapter and not (args.adapter / "adapter_config.json").is_file():
        parser().error(f"{args.adapter} has no adapter_config.json")
    from server import Server

    levels = [int(c) for c in args.concurrency.split(",")]
    extra = shlex.split(args.engine_args)
    model = "bench-base"
    engine = ["--served-model-name", model, "--max-model-len", str(args.prompt + args.output + 64), *extra]
    if args.adapter:
        engine += ["--enable-lora", "--max-loras", "1", "--lora-modules", f"bench={args.adapter}"]
        model = "bench"
    vocab = json.loads((args.model_dir / "config.json").read_text()).get("text_config", {}).get("vocab_size", 32000)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    server = Server("bench", str(args.model_dir), engine, args.port, args.out.with_suffix(".log"))
    t0 = time.monotonic()
    server.start()
    out = {"model": str(args.model_dir), "adapter": str(args.adapter or ""), "command": server.command}
    try:
        if not server.wait_ready(args.start_timeout):
            out["error"] = server.root_error()[:800] or "did not start"
            args.out.write_text(json.dumps(out, indent=2))
            print(f"serving_http: the server did not start: {out['error']}", file=sys.stderr)
            return 1
        out.update(ready_s=server.ready_s, **server.startup_figures(), rows=[])
        out["warmup"] = asyncio.run(level(server.url, model, prompts(1, args.prompt, vocab, seed=99), 16))
        touch(args.ready_file)
        if args.wait_for:
            out["gate"] = wait_for(args.wait_for, args.wait_timeout)
            print(f"serving_http: gate {out['gate']}", flush=True)
        for n in levels:
            if time.monotonic() - t0 > args.deadline:
                out["stopped_before"] = n
                break
            out["rows"].append(
                asyncio.run(level(server.url, model, prompts(n, args.prompt, vocab, seed=level_seed(n)), args.output))
            )
            args.out.write_text(json.dumps(out, indent=2))
            print(json.dumps(out["rows"][-1]), flush=True)
    finally:
        server.stop()
        args.out.write_text(json.dumps(out, indent=2))
        touch(args.ready_file)
        touch(args.done_file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
