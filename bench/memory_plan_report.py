"""Issue 19: doctor's memory plan (overlay/doctor/memory/arithmetic.py) against what aphrodite logged at start-up.

    python3 bench/memory_plan_report.py [--out bench/results]

Writes ``memory_plan.csv`` and ``memory_plan.md``: per configuration the predicted and the logged
figure, and their ratio. Two kinds of row:

- ``pool``: the whole plan. The engine profiled its memory (`aphrodite run`: run 11, DEBUG log with
  the profiling split, and runs 12-13's full-depth benchmark servers, INFO logs; or the benchmark's offline
  engine, run 10, INFO log): predicted available KV memory, KV tokens and concurrency against the logged
  ones.
- ``layout``: the KV layout alone. The server pinned its pool (--kv-cache-memory-bytes 2 GiB, the
  server suites of runs 10, 11, 13, 15 and 17; 28 GiB for run 14's full depth; 12 GiB for run 23's full-size
  35B-A3B, each release without and with LoRA): predicted tokens and
  concurrency for that pool against the logged ones (block size, page, groups, blocks per request).

The inputs are committed: each log, and what doctor reads of each model (the run's
``inputs-*.json``, or make-tiny's spec, whose config is rebuilt here without weights).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "gpu-runs"
GIB = 1 << 30
# the engine flags of ci/gpu-run.sh's compare stage (runs 22 and 23), LoRA rank 8 where LoRA is on
COMPARE_ENGINE = dict(utilization=0.15, max_model_len=832, max_num_seqs=64, language_model_only=True, max_lora_rank=8)
sys.path.insert(0, str(ROOT / "bench"))


def logged(text: str) -> dict:
    """The engine's figures (memory_calibration.figures), with the block size under its short name and the
    weights from "Model loading took" where the log has no DEBUG profiling split (run 10's INFO logs)."""
    from memory_calibration import figures

    found = figures(text)
    if "attention_block_size" in found:
        found["block_size"] = found["attention_block_size"]
    if "weights_gib" not in found and "model_loading_gib" in found:
        found["weights_gib"] = found["model_loading_gib"]
    if "total_consumed_gib" in found and "non_torch_gib" not in found:  # 0.23+: the split is no longer logged
        found["non_torch_gib"] = round(found["total_consumed_gib"] - found["weights_gib"], 2)
        if {"requested_gib", "non_kv_gib", "available_kv_gib"} <= set(found):  # the graph estimate, subtracted
            found["cudagraph_gib"] = round(found["requested_gib"] - found["non_kv_gib"] - found["available_kv_gib"], 2)
    return found


def tar_member(tgz: Path, name: str) -> str:
    with tarfile.open(tgz) as tar:
        for member in tar.getmembers():
            if member.name.endswith(name):
                return tar.extractfile(member).read().decode(errors="replace")
    raise FileNotFoundError(f"{name} in {tgz}")


def shape_of(config: dict):
    from hybrid_exl3_fixes.doctor import parse_config

    shape, problems = parse_config(config)
    if problems:
        raise ValueError(problems)
    return shape


def tiny_config(preset: str, **overrides) -> dict:
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, hf_config

    return hf_config(TinySpec.preset(preset, **overrides) if preset != "tiny" else TinySpec(**overrides))


def committed(path: Path) -> Path:
    """A run's file as committed: ``path``, or ``path.xz`` where the run's files were compressed."""
    packed = path.with_name(path.name + ".xz")
    return packed if not path.exists() and packed.exists() else path


def read_log(log: Path) -> str:
    """A run's log as text, compressed or not (``committed``)."""
    import lzma

    path = committed(log)
    raw = path.read_bytes()
    return (lzma.decompress(raw) if path.suffix == ".xz" else raw).decode(errors="replace")


def pool_row(name: str, log: Path, inputs: Path, engine) -> dict:
    """A configuration whose engine profiled: its log, what doctor read of its model (a run's inputs-*.json)."""
    from report import read_inputs

    saved = read_inputs(committed(inputs))
    return dict(
        kind="pool",
        name=name,
        source=str(log.relative_to(RUNS)).replace("2026-12-01-", ""),
        config=saved["config.json"],
        tensors=saved["tensors"],
        engine=engine,
        text=read_log(log),
    )


def rows() -> list[dict]:
    """(kind, name, source, config, tensors, engine arguments, logged text)."""
    from functools import partial

    from hybrid_exl3_fixes.doctor.memory import arithmetic

    # runs 10-14 ran aphrodite-engine 0.21.0 (prefix caching off by default there); later rows name their release
    Engine = partial(arithmetic.Engine, release="0.21.0")

    run10, run11 = RUNS / "2026-12-01-run10", RUNS / "2026-12-01-run11"
    out = [
        pool_row(
            f"{name} (aphrodite run, compiled, 24 GB card emulated)",
            run11 / "cal" / f"{name}.log",
            run11 / "cal" / "inputs-9b-exl3.json",
            Engine(24, utilization=0.9, max_model_len=32768, language_model_only=True, lora=lora, max_loras=4),
        )
        for name, lora in (("9b-24g", False), ("9b-24g-lora", True))
    ]
    # the benchmark's offline engines (bench/serving.py: LLM(..., gpu_memory_utilization=0.85)), INFO logs;
    # their checkpoint's header table was read with doctor.read_weights from make-tiny's qwen3.6-27b preset
    out += [
        pool_row(
            f"27B-width 4 layers, {name} (offline LLM, compiled, H200, util 0.85)",
            run10 / "bench" / f"engine-{name}.log",
            run10 / "bench" / "inputs-27b4-exl3.json",
            Engine(
                139.8,
                utilization=0.85,
                max_model_len=16384,
                max_num_seqs=128,
                max_num_batched_tokens=16384,
                language_model_only=True,
                lora=lora,
                max_loras=4,
                max_lora_rank=8,
            ),
        )
        for name, lora in (("exl3", False), ("exl3+lora", True))
    ]
    # the full-depth benchmark's server (bench/serving_http.py, run 12): the user's 27B shape at 64 layers on
    # the H200 with the engine's defaults there (utilization 0.9, --max-num-batched-tokens 8192, 1,024
    # sequences), INFO log; no constant of overlay/doctor/memory/arithmetic.py was taken from it
    run12 = RUNS / "2026-12-01-run12" / "fulldepth"
    out.append(
        pool_row(
            "27B full depth, EXL3 3 bits (aphrodite run, compiled, H200 defaults, held out)",
            run12 / "qwen3.6-27b-full-aphrodite-base.log",
            run12 / "inputs-qwen3.6-27b-full-exl3.json",
            Engine(139.8, max_model_len=832, language_model_only=True),
        )
    )
    # run 13's LoRA engine on the same checkpoint (--enable-lora --max-loras 1, the default rank 16), held out
    # too; its inputs are run 12's file (run 13's was byte-identical: the same make-tiny seed)
    out.append(
        pool_row(
            "27B full depth, EXL3 3 bits, LoRA (aphrodite run, compiled, H200 defaults, held out)",
            RUNS / "2026-12-01-run13" / "fulldepth" / "qwen3.6-27b-full-aphrodite-lora.log",
            run12 / "inputs-qwen3.6-27b-full-exl3.json",
            Engine(139.8, max_model_len=832, language_model_only=True, lora=True, max_loras=1),
        )
    )
    # run 14's calibration row (bench/memory_calibration.py, DEBUG log): eager and an fp8 KV pool in one start
    run14 = RUNS / "2026-12-01-run14"
    out.append(
        pool_row(
            "9b-24g-eager-fp8kv (aphrodite run, eager, fp8 KV, 24 GB card emulated)",
            run14 / "cal" / "9b-24g-eager-fp8kv.log",
            run11 / "cal" / "inputs-9b-exl3.json",
            Engine(24, utilization=0.9, max_model_len=32768, language_model_only=True, eager=True, kv_dtype="fp8"),
        )
    )
    # runs 10-13 served make-tiny checkpoints written before it set mamba_ssm_dtype: their GDN state was in
    # the activations' dtype, so these rows rebuild that config (ssm_dtype=None), as the engine saw it.
    # (label, engine logs, log, config, KV dtype, release, --enable-prefix-caching given)
    then = dict(ssm_dtype=None)
    logs10, logs11 = run10 / "server" / "engine-logs.tgz", run11 / "moe" / "engine-logs.tgz"
    logs13 = RUNS / "2026-12-01-run13" / "moe" / "engine-logs"
    logs15 = RUNS / "2026-12-01-run15" / "v24" / "suite" / "dense" / "engine-logs.tgz"
    logs17 = RUNS / "2026-12-02-run17" / "server" / "engine-logs.tgz"
    tiny_then, tiny_now = tiny_config("tiny", **then), tiny_config("tiny")
    pinned = [
        ("tiny bf16 state", logs10, "server-compiled-bf16-nolora.log", tiny_then, "auto", "0.21.0", None),
        (
            "tiny fp16 state",
            logs10,
            "server-compiled-fp16-nolora.log",
            tiny_config("tiny", dtype="float16", **then),
            "auto",
            "0.21.0",
            None,
        ),
        ("tiny bf16 state, fp8 KV", logs10, "server-compiled-bf16-lora-fp8kv.log", tiny_then, "fp8", "0.21.0", None),
        (
            "tiny bf16 state, --enable-prefix-caching",
            run10 / "prefix" / "engine-logs.tgz",
            "server-compiled-bf16-lora-prefix.log",
            tiny_then,
            "auto",
            "0.21.0",
            True,
        ),
        (
            "tiny-moe bf16 state",
            logs11,
            "server-moe-compiled-bf16-nolora.log",
            tiny_config("tiny-moe", **then),
            "auto",
            "0.21.0",
            None,
        ),
        (
            "35B-A3B width, 4 layers, bf16 state",
            logs13,
            "server-moe35-compiled-bf16-nolora.log",
            tiny_config("qwen3.6-35b-a3b", **then),
            "auto",
            "0.21.0",
            None,
        ),
        # 0.24.1: prefix caching (and with it two state blocks per request) on by default
        ("tiny bf16 state, 0.24.1", logs15, "server-compiled-bf16-lora.log", tiny_then, "auto", "0.24.1", None),
        # run 17 served make-tiny's checkpoints in the published form: mamba_ssm_dtype float32 in the config
        ("tiny float32 state, 0.24.1", logs17, "server-compiled-bf16-lora.log", tiny_now, "auto", "0.24.1", None),
        (
            "tiny float32 state, fp8 KV, 0.24.1",
            logs17,
            "server-compiled-bf16-lora-fp8kv.log",
            tiny_now,
            "fp8",
            "0.24.1",
            None,
        ),
    ]
    # run 14's full-depth engines, started two at once with the pool pinned at 28 GiB (bench/serving_http.py)
    full = json.loads((run12 / "inputs-qwen3.6-27b-full-exl3.json").read_text())["config.json"]
    out.append(
        layout_row(
            "27B full depth, EXL3 3 bits (aphrodite run, --kv-cache-memory-bytes 28 GiB)",
            "run14/fulldepth/qwen3.6-27b-full-aphrodite-base.log",
            full,
            Engine(139.8, max_model_len=832, language_model_only=True),
            read_log(run14 / "fulldepth" / "qwen3.6-27b-full-aphrodite-base.log"),
            28 << 30,
        )
    )
    # run 18's full-depth engines on 0.24.1 (prefix caching on by default), the config's float32 GDN state and
    # --mamba-ssm-cache-dtype bfloat16 (which replaces the config's value: aphrodite models/config.py)
    run18 = RUNS / "2026-12-03-run18" / "state-dtype"
    cfg18 = json.loads((run18 / "config.json").read_text())
    bf16 = with_ssm_dtype(cfg18, "bfloat16")
    for state, cfg, flag in (("float32", cfg18, ""), ("bf16", bf16, ", --mamba-ssm-cache-dtype bfloat16")):
        out.append(
            layout_row(
                f"27B full depth, {state} state{flag}, 0.24.1 (aphrodite run, --kv-cache-memory-bytes 28 GiB)",
                f"run18/state-dtype/qwen3.6-27b-full-{state}-state.log",
                cfg,
                arithmetic.Engine(139.8, max_model_len=832, language_model_only=True, release="0.24.1"),
                read_log(run18 / f"qwen3.6-27b-full-{state}-state.log"),
                28 << 30,
            )
        )
    # run 23's full-size 35B-A3B engines (ci/gpu-run.sh compare: 12 GiB pinned, 832 tokens, 64 sequences), each
    # release without and with LoRA, all four started at once on one H200
    from report import read_inputs

    run23 = RUNS / "2026-12-04-run23"
    moe = read_inputs(RUNS / "2026-12-03-run20" / "inputs-qwen3.6-35b-a3b-full-3bit-exl3.json.xz")["config.json"]
    for release, lora in (("0.24.1", False), ("0.24.1", True), ("0.21.0", False), ("0.21.0", True)):
        log = f"qwen3.6-35b-a3b-full-3bit-aphrodite-{release[:4]}{'-lora' if lora else ''}.log"
        out.append(
            layout_row(
                f"35B-A3B full size, EXL3 3 bits, float32 state, {release}{', LoRA rank 8' if lora else ''} "
                "(aphrodite run, --kv-cache-memory-bytes 12 GiB)",
                f"run23/{log}",
                moe,
                arithmetic.Engine(139.8, release=release, lora=lora, **COMPARE_ENGINE),
                read_log(run23 / log),
                12 << 30,
            )
        )
    # run 29's profiled starts on 0.24.1 (each engine planned for its own command's flags)
    out += cal_rows(RUNS / "2026-12-06-run29" / "cal", "0.24.1", gpu="H100")
    for label, logs, log, cfg, kv, release, prefix in pinned:
        text = read_log(logs / log) if logs.is_dir() else tar_member(logs, log)
        source = f"{logs.relative_to(RUNS)}/{log}".replace("2026-12-0", "").replace("/engine-logs.tgz", "")
        eng = arithmetic.Engine(
            139.8,
            max_model_len=2048,
            kv_dtype=kv,
            dtype=cfg["text_config"]["dtype"],
            release=release,
            prefix_caching=prefix,
        )
        out.append(
            layout_row(f"{label} (aphrodite run, --kv-cache-memory-bytes 2 GiB)", source, cfg, eng, text, 2 << 30)
        )
    return out


def cal_rows(cal: Path, release: str, names=None, gpu: str = "H200") -> list[dict]:
    """The profiled rows of one calibration run (bench/memory_calibration.py's ``<name>.json`` and ``.log`` in
    ``cal``, with the ``inputs-*.json`` it saved), each planned for the flags its command gave, on ``release``;
    ``names``: only these configurations; ``gpu``: the card the run had, for the label."""
    from memory_calibration import engine_from_command

    out = []
    for result_file in sorted(cal.glob("*.json")):
        if result_file.name.startswith("inputs-") or (names and result_file.stem not in names):
            continue
        result = json.loads(result_file.read_text())
        if "max_concurrency" not in result["logged"]:
            continue  # the engine did not get as far as its pool
        inputs = cal / f"inputs-{result['model'].replace('/', '-')}.json"
        engine = engine_from_command(result["command"], result["logged"]["total_gib"], release)
        label = f"{result['name']} ({release}, {gpu}, aphrodite run{', held out' if result.get('held_out') else ''})"
        out.append(pool_row(label, cal / f"{result['name']}.log", inputs, engine))
    return out


def layout_row(name: str, source: str, config: dict, engine, text: str, pool: int) -> dict:
    """A pinned-pool row: the engine's KV layout and capacity for ``pool`` bytes against its start-up log."""
    return dict(kind="layout", name=name, source=source, config=config, tensors={}, engine=engine, text=text, pool=pool)


def with_ssm_dtype(config: dict, dtype: str) -> dict:
    """``config`` with text_config.mamba_ssm_dtype = ``dtype``: the config as --mamba-ssm-cache-dtype resolves it."""
    return {**config, "text_config": {**config["text_config"], "mamba_ssm_dtype": dtype}}


def evaluate(row: dict) -> dict:
    from hybrid_exl3_fixes.doctor.memory import arithmetic

    shape = shape_of(row["config"])
    got = logged(row["text"])
    eng = row["engine"]
    layout = arithmetic.kv_layout(shape, eng)
    result = {"kind": row["kind"], "configuration": row["name"], "source": row["source"]}
    if row["kind"] == "layout":
        cap = arithmetic.kv_capacity(layout, row["pool"], eng.max_model_len)
        pairs = {"block_size": layout["block_size"], **{k: cap[k] for k in ("kv_cache_tokens", "max_concurrency")}}
    else:
        exl3 = any(n.endswith(".trellis") for n in row["tensors"])
        plan = arithmetic.plan(shape, row["tensors"], eng, exl3)
        cap = plan["capacity"]
        t = plan["terms"]
        pairs = {
            "weights_gib": round(arithmetic.loading_bytes(t) / GIB, 2),
            "torch_peak_gib": t["activation_peak"]["gib"],
            "non_torch_gib": round(t["non_torch"]["gib"] + t["runner_buffers"]["gib"], 3),
            "cudagraph_gib": t["cudagraphs"]["gib"],
            "available_kv_gib": plan["available_kv_gib"],
            "block_size": layout["block_size"],
            "kv_cache_tokens": cap["kv_cache_tokens"],
            "max_concurrency": cap["max_concurrency"],
        }
    if row["kind"] == "pool":  # the plan's range from its terms' bounds (overlay/doctor/memory/bounds.py)
        u = plan["uncertainty"]
        result["available_kv_gib range"] = f"{u['pool_gib'][0]:.2f}-{u['pool_gib'][1]:.2f}"
        result["kv_cache_tokens range"] = f"{u['kv_cache_tokens'][0]:,}-{u['kv_cache_tokens'][1]:,}"
    for key, predicted in pairs.items():
        result[f"{key} predicted"] = predicted
        result[f"{key} logged"] = got.get(key)
        result[f"{key} ratio"] = round(predicted / got[key], 4) if got.get(key) else None
    return result


def markdown(results: list[dict]) -> str:
    lines = [
        "# doctor's memory plan against aphrodite's start-up log",
        "",
        "Generated by `python3 bench/memory_plan_report.py`; predicted by `overlay/doctor/memory/arithmetic.py`,",
        "logged by",
        "aphrodite-engine 0.21.0 (runs 10 to 14) and 0.24.1 (rows marked 0.24.1: runs 15, 17 and 18), both releases",
        "in run 23, on one H200; run 29's profiled 0.24.1 rows on one H100 (marked H100) (docs/gpu-runs/).",
        "Ratio = predicted / logged; KV tokens and concurrency differ by the one factor max_model_len, so their",
        "ratios are the same.",
        "",
        "non_torch: 0.21.0 logs the non-torch increase of the profiling run; 0.23+ log the total consumed since the",
        "start-up snapshot instead, shown here less the weights, which takes in the model runner's buffers too",
        "(planned: non_torch + runner_buffers). cudagraph on 0.23+: requested - non-KV - available KV.",
        "",
        'GDN state: every row without "float32 state" in its name ran a checkpoint written before make-tiny set',
        "`mamba_ssm_dtype` (GDN state bfloat16, or float16 where named), half the state bytes of the published",
        "models, except run 18's row that names `--mamba-ssm-cache-dtype bfloat16` (the published form overridden).",
        "0.23.0+ turn prefix caching on by default, which holds two state blocks per request and state group",
        "(docs/upstream/hybrid-prefix-caching-state-blocks.md).",
        "",
        "Planned range: the pool and tokens at both ends of the plan's terms' bounds (overlay/doctor/memory/bounds.py:",
        "each bound rests on these rows or on a source it names), as doctor prints them.",
        "",
    ]
    for kind, keys in (
        (
            "pool",
            [
                "weights_gib",
                "torch_peak_gib",
                "non_torch_gib",
                "cudagraph_gib",
                "available_kv_gib",
                "kv_cache_tokens",
                "max_concurrency",
            ],
        ),
        ("layout", ["block_size", "kv_cache_tokens", "max_concurrency"]),
    ):
        chosen = [r for r in results if r["kind"] == kind]
        if not chosen:
            continue
        lines.append("## Whole plan (the engine profiled)" if kind == "pool" else "## KV layout (pool pinned)")
        lines.append("")
        ranges = ["available_kv_gib", "kv_cache_tokens"] if kind == "pool" else []
        head = [f"{k} predicted / logged (ratio)" for k in keys] + [f"{k} planned range" for k in ranges]
        lines.append("| configuration | " + " | ".join(head) + " |")
        lines.append("|---|" + "---|" * len(head))
        for r in chosen:
            cells = []
            for k in keys:
                p, g, q = r.get(f"{k} predicted"), r.get(f"{k} logged"), r.get(f"{k} ratio")
                cells.append(
                    "-" if p is None else f"{p:,} / {'n/a' if g is None else f'{g:,}'}" + (f" ({q})" if q else "")
                )
            cells += [r.get(f"{k} range", "-") for k in ranges]
            lines.append(f"| {r['configuration']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    results = [evaluate(r) for r in rows()]
    args.out.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in results for k in r}, key=lambda k: (k not in ("kind", "configuration", "source"), k))
    with open(args.out / "memory_plan.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(results)
    (args.out / "memory_plan.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
