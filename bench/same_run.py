"""Several engine configurations on one checkpoint, measured in one run, alternated level by level.

    python3 bench/same_run.py MODEL_DIR --out FILE.json --variant NAME="ENGINE ARGS" --variant ... \
        [--concurrency 1,32,64,128] [--repeats 3] [--prompt 512 --output 256] [--deadline SECONDS]

Every variant is the real `aphrodite run` (tests/gpu/server.py) on MODEL_DIR with the engine's defaults plus its own
arguments; all start at once, so each must pin its KV pool (``--kv-cache-memory-bytes``) and ask for a small
``--gpu-memory-utilization``. Once all have answered one warm-up request (and one warm-up level at the largest
concurrency, so that no variant meets a first-use cost inside a measured level) and every ``--hold-until`` file
exists (other work sharing the GPU has ended: the wait is kept as ``held_s``), every level is run ``--repeats``
times, the variants alternated (repeat 0: A, B; repeat 1: B, A; ...), with nothing else sent to the GPU meanwhile;
every level and repeat sends its own prompts (``level_seed``: the same for every variant, so that no level is
answered from a prefix cache the previous one filled). One formula for every variant (serving_http.level): decode
tok/s = completed requests x (output - 1) / (last token of any request - first token of any request); per-request
tok/s = mean over requests of (output - 1) / (its last token - its first token). The JSON keeps every repeat, the
median and the spread (min, max) per variant and level, and each variant's start-up figures (KV tokens, concurrency,
block size as the engine logged them). Results are written after every level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_http import ROOT, level, level_seed, prompts  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "gpu"))

METRICS = ("decode_tok_s", "per_request_tok_s", "ttft_mean_s")


def variant(text: str) -> tuple[str, list[str]]:
    name, sep, args = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f'--variant takes NAME="ENGINE ARGS", got {text!r}')
    return name.strip(), shlex.split(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variant", type=variant, action="append", required=True, help='NAME="ENGINE ARGS"')
    p.add_argument("--concurrency", default="1,32,64,128")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--deadline", type=float, default=1e9, help="start no measured level after this many seconds")
    p.add_argument(
        "--hold-until",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="after the warm-up, measure nothing until FILE exists (or the deadline passes)",
    )
    return p


def summarise(rows: list[dict]) -> dict:
    out = {}
    for m in METRICS:
        values = [r[m] for r in rows if r.get(m) is not None]
        if values:
            out[m] = {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        parser().error(f"{args.model_dir} has no config.json")
    names = [n for n, _ in args.variant]
    if len(set(names)) != len(names):
        parser().error(f"variant names repeat: {names}")
    from server import Server

    levels = [int(c) for c in args.concurrency.split(",")]
    vocab = json.loads((args.model_dir / "config.json").read_text()).get("text_config", {}).get("vocab_size", 32000)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    servers = {}
    for i, (name, extra) in enumerate(args.variant):
        engine = ["--served-model-name", name, "--max-model-len", str(args.prompt + args.output + 64), *extra]
        log = args.out.with_name(f"{args.out.stem}-{name}.log")
        servers[name] = Server(name, str(args.model_dir), engine, args.port + i, log)
        servers[name].start()
    out = {"model": str(args.model_dir), "formula": __doc__.split("One formula")[1].split("The JSON")[0].strip()}
    out["prompts"] = "seeded by level_seed(concurrency, repeat): fresh per level and repeat, shared by variants"
    out["variants"] = {n: {"command": s.command} for n, s in servers.items()}
    out["levels"], out["repeats"], out["runs"] = levels, args.repeats, []

    def save() -> None:
        out["summary"] = {
            n: {
                str(c): summarise([r for r in out["runs"] if r["variant"] == n and r["concurrency"] == c])
                for c in levels
            }
            for n in servers
        }
        args.out.write_text(json.dumps(out, indent=2))

    try:
        for name, server in servers.items():
            up = server.wait_ready(max(1.0, args.start_timeout - (time.monotonic() - t0)))
            out["variants"][name].update(started=up, ready_s=server.ready_s, **server.startup_figures())
            if not up:
                out["variants"][name]["error"] = server.root_error()[:800] or "did not start"
        live = [n for n in servers if out["variants"][n]["started"]]
        save()
        for name in live:  # warm-up: one request, then the largest level once
            url = servers[name].url
            out["variants"][name]["warmup"] = asyncio.run(level(url, name, prompts(1, args.prompt, vocab, seed=99), 16))
            asyncio.run(level(url, name, prompts(max(levels), args.prompt, vocab, seed=98), 16))
        held = time.monotonic()
        while any(not f.exists() for f in args.hold_until) and time.monotonic() - t0 < args.deadline:
            time.sleep(2)
        out["held_s"] = round(time.monotonic() - held, 1)
        for rep in range(args.repeats):
            order = live if rep % 2 == 0 else live[::-1]
            for n in levels:
                for name in order:
                    if time.monotonic() - t0 > args.deadline:
                        out["stopped"] = {"repeat": rep, "concurrency": n, "variant": name}
                        return 0
                    row = asyncio.run(
                        level(
                            servers[name].url,
                            name,
                            prompts(n, args.prompt, vocab, seed=level_seed(n, rep)),
                            args.output,
                        )
                    )
                    out["runs"].append({"variant": name, "repeat": rep, **row})
                    save()
                    print(json.dumps(out["runs"][-1]), flush=True)
    finally:
        for server in servers.values():
            server.stop()
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
