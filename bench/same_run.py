"""Several engine configurations on one checkpoint, measured in one run, alternated level by level.

    python3 bench/same_run.py MODEL_DIR --out FILE.json --variant NAME="ENGINE ARGS" --variant ... \
        [--exllamav3 NAME] [--variant-env NAME="KEY=VALUE ..."] [--start-after NAME=FILE] \
        [--concurrency 1,32,64,128] [--repeats 3] [--prompt 512 --output 256] [--deadline SECONDS]

Every ``--variant`` is the real `aphrodite run` (tests/gpu/server.py) on MODEL_DIR with the engine's defaults plus
its own arguments, in the environment ``--variant-env`` gives it (another release's PYTHONPATH and PATH, an overlay
switch), and every ``--exllamav3`` variant exllamav3's generator on the same checkpoint (bench/exl3_worker.py:
loaded, warmed up with Model.warmup and the largest batch, then asked one level at a time); all start at once (one
named in ``--start-after NAME=FILE`` once FILE exists: exllamav3 while its extension still builds), so each must
pin its KV pool (``--kv-cache-memory-bytes``) and ask for a small ``--gpu-memory-utilization``. Once all
have answered one warm-up request (and one warm-up level at the largest concurrency, so that no variant meets a
first-use cost inside a measured level) and every ``--hold-until`` file exists (other work sharing the GPU has
ended: the wait is kept as ``held_s``), every level is run ``--repeats`` times, the variants alternated (repeat 0:
A, B; repeat 1: B, A; ...), with nothing else sent to the GPU meanwhile; every level and repeat sends its own
prompts (``level_seed``: the same for every variant, so that no level is answered from a prefix cache the previous
one filled). One formula for every variant (serving_http.level; exllamav3_generator.run_level times its tokens the
same way): decode tok/s = completed requests x (output - 1) / (last token of any request - first token of any
request); per-request tok/s = mean over requests of (output - 1) / (its last token - its first token). The JSON
keeps every repeat, the median and the spread (min, max) per variant and level, and each variant's start-up figures
(KV tokens, concurrency, block size as the engine logged them). Results are written after every level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import statistics
import sys
import threading
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


def request_model(name: str, args: list[str]) -> str:
    """What a variant's requests name: the adapter of its ``--lora-modules A=PATH`` (so that every request of a LoRA
    variant goes through the adapter), else the variant (its --served-model-name)."""
    if "--lora-modules" in args and args.index("--lora-modules") + 1 < len(args):
        return args[args.index("--lora-modules") + 1].split("=")[0]
    return name


def variant_env(text: str) -> tuple[str, dict]:
    name, sep, pairs = text.partition("=")
    env = dict(pair.partition("=")[::2] for pair in shlex.split(pairs))
    if not sep or not name.strip() or any(not k for k in env):
        raise argparse.ArgumentTypeError(f'--variant-env takes NAME="KEY=VALUE ...", got {text!r}')
    return name.strip(), env


def variant_levels(text: str) -> tuple[str, list[int]]:
    name, sep, value = text.partition("=")
    try:
        levels = [int(c) for c in value.split(",")]
    except ValueError:
        levels = []
    if not sep or not name or not levels:
        raise argparse.ArgumentTypeError(f"--levels takes NAME=N,N (integers), got {text!r}")
    return name, levels


def start_after(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"--start-after takes NAME=FILE, got {text!r}")
    return name.strip(), Path(path.strip())


def held_start(server, flag: Path, until: float, cancel: threading.Event, poll: float = 2.0):
    """Start ``server`` once ``flag`` exists, from a thread; an empty flag starts it, one with text leaves it
    unstarted, as does the wait's end when ``until`` passes first or ``cancel`` is set (the run is ending: nothing
    starts after its servers were stopped). Returns the thread and its outcome: ``held_s`` once the wait has ended,
    and ``reason`` where the server was left unstarted."""
    outcome: dict = {}

    def run() -> None:
        while not flag.exists() and time.monotonic() < until and not cancel.wait(poll):
            pass
        text = flag.read_text(errors="replace").strip() if flag.exists() else f"{flag} did not appear in time"
        if text or cancel.is_set():
            outcome["reason"] = text or "the run ended first"
        else:
            server.start()
        outcome["held_s"] = round(time.monotonic() - t_start, 1)

    t_start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variant", type=variant, action="append", required=True, help='NAME="ENGINE ARGS"')
    p.add_argument(
        "--exllamav3",
        action="append",
        default=[],
        metavar="NAME",
        help="one more variant: exllamav3's generator on the same checkpoint (bench/exl3_worker.py)",
    )
    p.add_argument(
        "--variant-env",
        type=variant_env,
        action="append",
        default=[],
        metavar='NAME="KEY=VALUE ..."',
        help="environment of one variant (another release's PYTHONPATH and PATH, HYBRID_EXL3_FIXES_DISABLE=P8, "
        "exllamav3's PYTHONPATH); with PATH, that PATH's aphrodite console script is run",
    )
    p.add_argument(
        "--start-after",
        type=start_after,
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="start variant NAME only once FILE exists (an extension still building), the others meanwhile; FILE "
        "with text in it: leave NAME out, that text its reason",
    )
    p.add_argument("--concurrency", default="1,32,64,128")
    p.add_argument(
        "--levels",
        type=variant_levels,
        action="append",
        default=[],
        metavar="NAME=N,N",
        help="the levels variant NAME runs (a subset of --concurrency; default all): its warm-up and exllamav3's "
        "batch size follow its largest",
    )
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
    names = [n for n, _ in args.variant] + args.exllamav3
    if len(set(names)) != len(names):
        parser().error(f"variant names repeat: {names}")
    envs, holds, own = dict(args.variant_env), dict(args.start_after), dict(args.levels)
    for flag, given in (("--variant-env", envs), ("--start-after", holds), ("--levels", own)):
        if set(given) - set(names):
            parser().error(f"{flag} names no variant: {sorted(set(given) - set(names))}")
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser().error(f"--concurrency takes a comma list of integers, not {args.concurrency!r}")
    for name, subset in own.items():
        if set(subset) - set(levels):
            parser().error(f"--levels {name}: {sorted(set(subset) - set(levels))} not in --concurrency")

    def levels_of(name: str) -> list[int]:
        return own.get(name, levels)

    from exl3_worker import Exl3Worker

    from server import Server

    vocab = json.loads((args.model_dir / "config.json").read_text()).get("text_config", {}).get("vocab_size", 32000)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    servers = {}
    for i, (name, extra) in enumerate(args.variant):
        engine = ["--served-model-name", name, "--max-model-len", str(args.prompt + args.output + 64), *extra]
        log = args.out.with_name(f"{args.out.stem}-{name}.log")
        env = envs.get(name, {})
        exe = []
        if "PATH" in env:  # the console script in its PATH's first folder (a staged release's bin/), else the entry
            # point under the variant's own PYTHONPATH; never one further down that PATH, which may be another
            # release's (`pip install --target SITE` replaces SITE/bin, the staged 0.21.0's wrapper with it)
            found = shutil.which("aphrodite", path=env["PATH"].split(os.pathsep)[0])
            exe = [found] if found else [sys.executable, "-m", "aphrodite.entrypoints.cli.main"]
        servers[name] = Server(name, str(args.model_dir), engine, args.port + i, log, env=env, exe=exe)
    for name in args.exllamav3:
        log = args.out.with_name(f"{args.out.stem}-{name}.log")
        servers[name] = Exl3Worker(
            name, str(args.model_dir), log, envs.get(name, {}), max(levels_of(name)), args.prompt, args.output
        )
    cancel = threading.Event()
    waiting = {n: held_start(servers[n], holds[n], t0 + args.start_timeout, cancel) for n in servers if n in holds}
    for name in servers:
        if name not in waiting:
            servers[name].start()
    out = {"model": str(args.model_dir), "formula": __doc__.split("One formula")[1].split("The JSON")[0].strip()}
    out["prompts"] = "seeded by level_seed(concurrency, repeat): fresh per level and repeat, shared by variants"
    out["variants"] = {n: {"command": s.command} for n, s in servers.items()}
    out["levels"], out["repeats"], out["runs"] = levels, args.repeats, []
    out["prompt"], out["output"] = args.prompt, args.output
    if own:
        out["variant_levels"] = {n: levels_of(n) for n in servers}

    def save() -> None:
        out["summary"] = {
            n: {
                str(c): summarise([r for r in out["runs"] if r["variant"] == n and r["concurrency"] == c])
                for c in levels_of(n)
            }
            for n in servers
        }
        args.out.write_text(json.dumps(out, indent=2))

    def measure(server, n: int, seed: int) -> dict:
        if isinstance(server, Exl3Worker):  # the same prompts: the worker draws prompts(n, prompt, vocab, seed)
            return server.level(n, seed, args.output)
        model = request_model(server.name, server.args)
        return asyncio.run(level(server.url, model, prompts(n, args.prompt, vocab, seed=seed), args.output))

    def left() -> float:
        return max(1.0, args.start_timeout - (time.monotonic() - t0))

    try:
        for name, server in servers.items():
            if name in waiting:  # its start waited for a file: started, or left out with the file's text
                thread, outcome = waiting[name]
                thread.join(left() + 5)  # its own wait ends at the same start deadline
                out["variants"][name]["held_s"] = outcome.get("held_s")
                if "held_s" not in outcome or "reason" in outcome:
                    reason = outcome.get("reason", "its start did not come in time")
                    out["variants"][name].update(started=False, error=f"not started: {reason}"[:800])
                    continue
            # every variant's start has the same deadline, t0 + --start-timeout; wait_ready counts from the
            # server's own start, so it gets what is left of that deadline from there, not from now
            up = server.wait_ready(t0 + args.start_timeout - server.started)
            out["variants"][name].update(started=up, ready_s=server.ready_s, **server.startup_figures())
            if not up:
                out["variants"][name]["error"] = server.root_error()[:800] or "did not start"
        live = [n for n in servers if out["variants"][n]["started"]]
        save()
        for name in live:  # warm-up: one request, then the largest level once (the exllamav3 worker's own, at start)
            if isinstance(servers[name], Exl3Worker):
                out["variants"][name]["warmup"] = servers[name].warmup()
                continue
            url = servers[name].url
            model = request_model(name, servers[name].args)
            out["variants"][name]["warmup"] = asyncio.run(
                level(url, model, prompts(1, args.prompt, vocab, seed=99), 16)
            )
            asyncio.run(level(url, model, prompts(max(levels_of(name)), args.prompt, vocab, seed=98), 16))
        held = time.monotonic()
        while any(not f.exists() for f in args.hold_until) and time.monotonic() - t0 < args.deadline:
            time.sleep(2)
        out["held_s"] = round(time.monotonic() - held, 1)
        for rep in range(args.repeats):
            order = live if rep % 2 == 0 else live[::-1]
            for n in levels:
                for name in order:
                    if n not in levels_of(name):
                        continue
                    if time.monotonic() - t0 > args.deadline:
                        out["stopped"] = {"repeat": rep, "concurrency": n, "variant": name}
                        return 0
                    row = measure(servers[name], n, level_seed(n, rep))
                    out["runs"].append({"variant": name, "repeat": rep, **row})
                    save()
                    print(json.dumps(out["runs"][-1]), flush=True)
    finally:
        cancel.set()
        for thread, _ in waiting.values():
            thread.join(10)
        for server in servers.values():
            server.stop()
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
