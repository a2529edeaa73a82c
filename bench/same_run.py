"""Several engine configurations on one checkpoint, measured in one run, alternated level by level.

    python3 bench/same_run.py MODEL_DIR --out FILE.json --variant NAME="ENGINE ARGS" --variant ... \
        [--exllamav3 NAME[="GENERATOR ARGS"]] [--variant-env NAME="KEY=VALUE ..."] [--start-after NAME=FILE] \
        [--concurrency 1,8,16,32,64] [--repeats 5] [--prompt 512 --output 256] [--deadline SECONDS] \
        [--bandwidth-file BANDWIDTH.json] [--watch-dir DIR]... [--no-pause] \
        [--exllamav3-draft ALIAS=NAME:K]... [--pool NAME=LO:HI]...

Every ``--variant`` is the real `aphrodite run` (tests/gpu/server.py) on MODEL_DIR with the engine's defaults plus
its own arguments, in the environment ``--variant-env`` gives it (another release's PYTHONPATH and PATH, an overlay
switch), and every ``--exllamav3`` variant exllamav3's generator on the same checkpoint (bench/exl3_worker.py, with
its own arguments: ``--state-dtype float32``); all start at once (one named in ``--start-after NAME=FILE`` once FILE
exists: exllamav3 while its extension still builds), so each aphrodite variant must pin its KV pool
(``--kv-cache-memory-bytes``) and ask for a small ``--gpu-memory-utilization``.

Once all have started, every variant runs each of its levels once, unmeasured, with the measured prompt and output
lengths (``warmup_seed``: every batch shape and sampler path is met before it is measured); once every
``--hold-until`` file exists (other work sharing the GPU has ended: the wait is kept as ``held_s``), every level is
run ``--repeats`` times, the variants alternated (repeat 0: A, B; repeat 1: B, A; ...), the repeats outermost (a
run cut at its deadline keeps whole repeats). While one variant is measured, every other is stopped (SIGSTOP of its
process tree, bench/pause.py; ``--no-pause`` leaves them running), so that no idle engine takes host or GPU time;
every level and repeat sends its own prompts (``level_seed``: the same for every variant). One formula for every
variant: bench/level_figures.py. A level is reported only when bench/level_checks.py finds nothing against it (all
N requests streaming at once, one chunk a token, no preemption, nothing compiled inside its window); otherwise its
row keeps the reasons under ``refused`` and the summary leaves it out. The JSON keeps every repeat, the median and
the spread (min, max) of the reported ones per variant and level, each variant's start-up figures (KV tokens,
concurrency, block size as the engine logged them) and its GDN state dtype, the copy bandwidth measured before the
engines started (``--bandwidth-file``) and every compile found. Results are written after every level.

Speculative decoding: an aphrodite variant with ``--speculative-config`` streams a step's accepted tokens in one chunk,
so its requests are checked by the engine's own token count (usage); each of its rows keeps the engine's
speculative counters over that level (``spec``: drafts, draft tokens, accepted tokens, acceptance per position, read
from /metrics). An exllamav3 variant started with ``--mtp K`` (its MTP head loaded as the draft model) is measured
without drafting; each ``--exllamav3-draft ALIAS=NAME:K`` is one more variant measured through NAME's process with
K draft tokens a step (exllamav3's ``num_draft_tokens``), its rows keeping the generator's own accepted and rejected
draft tokens. ``--pool NAME=LO:HI`` (repeatable) draws each level's prompt ids from ``[LO, HI)``, one token pool of a
make-tiny ``--mtp-acceptance`` checkpoint (its requests then follow that pool's cycle at its rate), and runs every
level once per pool; rows carry ``pool`` and the summary is keyed ``POOL/N``.
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
import level_checks  # noqa: E402
import pause  # noqa: E402
from level_figures import FORMULA, level_seed, prompts, warmup_seed  # noqa: E402
from serving_http import ROOT, level  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "gpu"))

METRICS = ("decode_tok_s", "per_request_tok_s", "ttft_mean_s")
SSM_FLAG = "--mamba-ssm-cache-dtype"


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


def exllamav3_variant(text: str) -> tuple[str, list[str]]:
    """``NAME`` or ``NAME=GENERATOR ARGS`` (bench/exllamav3_generator.py's own flags, ``--state-dtype float32``)."""
    name, _, args = text.partition("=")
    if not name.strip():
        raise argparse.ArgumentTypeError(f'--exllamav3 takes NAME or NAME="GENERATOR ARGS", got {text!r}')
    return name.strip(), shlex.split(args)


def draft_alias(text: str) -> tuple[str, str, int]:
    alias, sep, rest = text.partition("=")
    name, _, k = rest.rpartition(":")
    if not sep or not alias.strip() or not name.strip() or not k.isdigit() or int(k) < 1:
        raise argparse.ArgumentTypeError(f"--exllamav3-draft takes ALIAS=NAME:K (K >= 1), got {text!r}")
    return alias.strip(), name.strip(), int(k)


def token_pool(text: str) -> tuple[str, tuple[int, int]]:
    name, sep, span = text.partition("=")
    lo, _, hi = span.partition(":")
    if not sep or not name.strip() or not (lo.isdigit() and hi.isdigit()) or int(lo) >= int(hi):
        raise argparse.ArgumentTypeError(f"--pool takes NAME=LO:HI (integers, LO < HI), got {text!r}")
    return name.strip(), (int(lo), int(hi))


def speculative(args: list[str]) -> bool:
    return "--speculative-config" in args


def state_dtype(args: list[str], config: dict, exllamav3: bool) -> str:
    """The GDN recurrent state's dtype a variant serves: exllamav3's ``--state-dtype`` (its default float16);
    aphrodite's ``--mamba-ssm-cache-dtype``, else the config's ``mamba_ssm_dtype``, else the model's dtype
    (models/config.py Qwen3_5ForConditionalGenerationConfig)."""
    flag = "--state-dtype" if exllamav3 else SSM_FLAG
    if flag in args[:-1]:
        return args[args.index(flag) + 1]
    if exllamav3:
        return "float16"
    text = config.get("text_config", config)
    return text.get("mamba_ssm_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"


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
    p.add_argument("--variant", type=variant, action="append", default=[], help='NAME="ENGINE ARGS"')
    p.add_argument(
        "--exllamav3",
        type=exllamav3_variant,
        action="append",
        default=[],
        metavar='NAME[="GENERATOR ARGS"]',
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
    p.add_argument(
        "--exllamav3-draft",
        type=draft_alias,
        action="append",
        default=[],
        metavar="ALIAS=NAME:K",
        help="one more variant: exllamav3 variant NAME's process (started with --mtp) drafting K tokens a step",
    )
    p.add_argument(
        "--pool",
        type=token_pool,
        action="append",
        default=[],
        metavar="NAME=LO:HI",
        help="prompt ids from [LO, HI) (a token pool of a --mtp-acceptance checkpoint); every level once per pool",
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
    p.add_argument("--repeats", type=int, default=5)
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
    p.add_argument(
        "--bandwidth-file",
        type=Path,
        help="bench/roofline.py --measure's JSON, measured on this GPU before the engines started: kept in the "
        "results for the roofline",
    )
    p.add_argument(
        "--watch-dir",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="a compile cache (Triton, Inductor, FlashInfer, torch.compile): a file appearing in it inside a "
        "measured level's window refuses that level",
    )
    p.add_argument("--no-pause", action="store_true", help="leave the variants not being measured running (no SIGSTOP)")
    return p


def summarise(rows: list[dict]) -> dict:
    """Median and spread of the reported rows; ``refused``: how many rows were left out, and why (the first)."""
    kept = [r for r in rows if not r.get("refused")]
    out = {}
    for m in METRICS:
        values = [r[m] for r in kept if r.get(m) is not None]
        if values:
            out[m] = {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}
    if len(kept) < len(rows):
        out["refused"] = {"rows": len(rows) - len(kept), "first": next(r["refused"] for r in rows if r.get("refused"))}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        parser().error(f"{args.model_dir} has no config.json")
    names = [n for n, _ in args.variant] + [n for n, _ in args.exllamav3] + [a for a, _, _ in args.exllamav3_draft]
    if not names:
        parser().error("give at least one --variant or --exllamav3")
    if len(set(names)) != len(names):
        parser().error(f"variant names repeat: {names}")
    envs, holds, own = dict(args.variant_env), dict(args.start_after), dict(args.levels)
    for flag, given in (("--variant-env", envs), ("--start-after", holds), ("--levels", own)):
        if set(given) - set(names):
            parser().error(f"{flag} names no variant: {sorted(set(given) - set(names))}")
    x3_names = {n for n, _ in args.exllamav3}
    for alias, base, _ in args.exllamav3_draft:
        if base not in x3_names:
            parser().error(f"--exllamav3-draft {alias}: {base} is no --exllamav3 variant")
        if "--mtp" not in dict(args.exllamav3)[base]:
            parser().error(f"--exllamav3-draft {alias}: {base} was not started with --mtp K")
        if alias in holds:
            parser().error(f"--start-after {alias}: a draft variant starts with {base}")
    pools = dict(args.pool)
    if len(pools) != len(args.pool):
        parser().error("--pool names repeat")
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser().error(f"--concurrency takes a comma list of integers, not {args.concurrency!r}")
    for name, subset in own.items():
        if set(subset) - set(levels):
            parser().error(f"--levels {name}: {sorted(set(subset) - set(levels))} not in --concurrency")
    bandwidth = None
    if args.bandwidth_file:
        try:
            bandwidth = json.loads(args.bandwidth_file.read_text())
            float(bandwidth["copy_bandwidth_gbps"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser().error(f"--bandwidth-file {args.bandwidth_file}: not roofline.py --measure's JSON ({e})")

    def levels_of(name: str) -> list[int]:
        return own.get(name, levels)

    from exl3_worker import DraftAlias, Exl3Worker

    from server import Server

    config = json.loads((args.model_dir / "config.json").read_text())
    vocab = config.get("text_config", {}).get("vocab_size", 32000)
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
    for name, extra in args.exllamav3:
        log = args.out.with_name(f"{args.out.stem}-{name}.log")
        top = max(levels_of(name))
        servers[name] = Exl3Worker(
            name, str(args.model_dir), log, envs.get(name, {}), top, args.prompt, args.output, extra
        )
    for alias, base, k in args.exllamav3_draft:
        servers[alias] = DraftAlias(alias, servers[base], k)
    is_x3 = {n: isinstance(s, (Exl3Worker, DraftAlias)) for n, s in servers.items()}
    owner = {n: (s.worker.name if isinstance(s, DraftAlias) else n) for n, s in servers.items()}  # whose process
    spec = {n: isinstance(s, DraftAlias) or (not is_x3[n] and speculative(s.args)) for n, s in servers.items()}
    pool_list = list(pools.items()) or [(None, None)]
    cancel = threading.Event()
    waiting = {n: held_start(servers[n], holds[n], t0 + args.start_timeout, cancel) for n in servers if n in holds}
    for name in servers:
        if name not in waiting:
            servers[name].start()
    out = {"model": str(args.model_dir), "formula": FORMULA, "checks": level_checks.__doc__.strip()}
    out["prompts"] = "seeded by level_seed(concurrency, repeat): fresh per level and repeat, shared by variants"
    out["variants"] = {
        n: {"command": s.command, "state_dtype": state_dtype(getattr(s, "args", []), config, is_x3[n])}
        for n, s in servers.items()
    }
    out["levels"], out["repeats"], out["runs"] = levels, args.repeats, []
    if pools:
        out["pools"] = {n: list(span) for n, span in pools.items()}
    for name, server in servers.items():
        if isinstance(server, DraftAlias):
            out["variants"][name].update(draft_tokens=server.draft, process_of=server.worker.name)
        out["variants"][name]["speculative"] = spec[name]
    out["prompt"], out["output"], out["pause_idle"] = args.prompt, args.output, not args.no_pause
    if bandwidth:
        out["bandwidth"] = bandwidth
    if own:
        out["variant_levels"] = {n: levels_of(n) for n in servers}
    stopped: set[str] = set()  # variants whose process tree is SIGSTOPped now
    counted: dict[str, tuple] = {}  # variant -> (its counters before its last level, that row)

    def save() -> None:
        out["summary"] = {
            n: {
                (f"{pool}/{c}" if pool else str(c)): summarise(
                    [r for r in out["runs"] if r["variant"] == n and r["concurrency"] == c and r.get("pool") == pool]
                )
                for pool, _ in pool_list
                for c in levels_of(n)
            }
            for n in servers
        }
        args.out.write_text(json.dumps(out, indent=2))

    def focus(name: str, live: list[str]) -> list[str]:
        """Stop every live variant but ``name``, resume ``name``: the variants stopped while it runs."""
        if args.no_pause:
            return []
        me = owner[name]
        for other in live:
            o = owner[other]
            if o != me and o not in stopped and servers[o].proc is not None:
                pause.stop(servers[o].proc.pid)
                stopped.add(o)
        name = me
        if name in stopped:
            pause.resume(servers[name].proc.pid)
            stopped.discard(name)
            if not is_x3[name]:  # back to serving before it is measured
                deadline = time.monotonic() + 60
                while not servers[name].healthy() and time.monotonic() < deadline:
                    time.sleep(0.5)
        return sorted(stopped)

    def read_counters(name: str) -> tuple[float | None, dict] | None:
        """aphrodite's preemption and speculative counters now; their rise since the variant's last level goes to
        that level's row (``preemptions``; ``spec``, level_checks.spec_figures)."""
        if is_x3[name]:
            return None
        import httpx

        try:
            text = httpx.get(servers[name].url + "/metrics", timeout=10).text
            now = (level_checks.preemptions(text), level_checks.spec_counters(text))
        except httpx.HTTPError:
            now = (None, {})
        before, last = counted.get(name, (None, None))
        if last is not None and before is not None:
            if now[0] is not None and before[0] is not None:
                last["preemptions"] = now[0] - before[0]
            if spec[name]:
                last["spec"] = level_checks.spec_figures(before[1], now[1])
        return now

    def measure(name: str, n: int, seed: int, pool=None) -> dict:
        server = servers[name]
        if is_x3[name]:  # the same prompts: the worker draws prompts(n, prompt, vocab, seed, pool)
            return server.level(n, seed, args.output, pool=pool)
        model = request_model(server.name, server.args)
        ids = prompts(n, args.prompt, vocab, seed=seed, pool=pool)
        return asyncio.run(level(server.url, model, ids, args.output))

    def left() -> float:
        return max(1.0, args.start_timeout - (time.monotonic() - t0))

    measured_from = None
    try:
        for name, server in servers.items():
            if isinstance(server, DraftAlias):  # up when its worker is
                up = out["variants"][server.worker.name].get("started", False)
                out["variants"][name].update(started=up, ready_s=server.ready_s, **server.startup_figures())
                if not up:
                    out["variants"][name]["error"] = f"{server.worker.name} did not start"
                continue
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
        first_pool = pool_list[0][1]  # the warm-ups' prompts: one pool is every shape's
        for name in live:  # every measured shape once, unmeasured, with the measured lengths
            focus(name, live)
            v = out["variants"][name]
            if is_x3[name]:
                v["warmup"] = servers[name].warmup()
            else:
                model = request_model(name, servers[name].args)
                ids = prompts(1, args.prompt, vocab, 99, pool=first_pool)
                v["warmup"] = asyncio.run(level(servers[name].url, model, ids, 16))
            v["warmup_levels"] = []
            for n in levels_of(name):
                row = measure(name, n, warmup_seed(n), first_pool)
                v["warmup_levels"].append({k: row.get(k) for k in ("concurrency", "completed", "active", "wall_s")})
            save()
        held = time.monotonic()
        while any(not f.exists() for f in args.hold_until) and time.monotonic() - t0 < args.deadline:
            time.sleep(2)
        out["held_s"] = round(time.monotonic() - held, 1)
        measured_from = time.time()
        for rep in range(args.repeats):
            order = live if rep % 2 == 0 else live[::-1]
            for p, (pool, span) in enumerate(pool_list):
                for n in levels:
                    for name in order:
                        if n not in levels_of(name):
                            continue
                        if time.monotonic() - t0 > args.deadline:
                            out["stopped"] = {"repeat": rep, "concurrency": n, "variant": name, "pool": pool}
                            return 0
                        paused = focus(name, live)
                        before = read_counters(name)
                        seed = level_seed(n, rep) + 100_000 * p
                        row = {"variant": name, "repeat": rep, **({"pool": pool} if pool else {})}
                        row.update(measure(name, n, seed, span), paused=paused)
                        counted[name] = (before, row)
                        out["runs"].append(row)
                        save()
                        print(json.dumps(row), flush=True)
    finally:
        cancel.set()
        for thread, _ in waiting.values():
            thread.join(10)
        for name in sorted(stopped):  # a stopped process acts on no signal: resume before stopping for good
            pause.resume(servers[name].proc.pid)
        stopped.clear()
        if measured_from is not None:
            time.sleep(2)  # the counters lag the last response by a moment
            for name in counted:
                read_counters(name)
            logs = {n: s.log.read_text(errors="replace") for n, s in servers.items() if not is_x3[n] and s.log.exists()}
            files = level_checks.new_files(args.watch_dir, measured_from)
            out["compiles"] = level_checks.attribute_compiles(out["runs"], files, logs)
            out["compile_check"] = {"watched": [str(d) for d in args.watch_dir], "jit_monitor_logs": sorted(logs)}
            for row in out["runs"]:
                row["refused"] = level_checks.refusals(row, args.output, is_x3[row["variant"]], spec[row["variant"]])
        for server in servers.values():
            server.stop()
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
