"""Tuned LoRA shrink/expand kernel configs for the Qwen3.6-27B's adapted projections, in the files aphrodite reads
from ``APHRODITE_TUNED_CONFIG_FOLDER``, and the per-step kernel time they save against the default configs.

    python3 bench/lora_tune.py --out DIR [--rank 8] [--deadline 150]     # on the GPU machine, aphrodite 0.24+
    python3 bench/lora_tune.py --report DIR/lora_tune.json --out bench/results        # anywhere

aphrodite 0.24's ``lora/ops/triton_ops/utils.py`` looks a launch up in ``<GPU>_SHRINK.json`` and
``<GPU>_EXPAND_<TRUE|FALSE>.json`` (``get_lora_op_configs``: keyed max_loras / num_slices / m / k / n, each level
but num_slices matched to the nearest key); without them every launch takes one default config (shrink: block_m
32, block_k 256, split_k 64 below 128 rows; expand: block_m 64, block_k 32, whatever the rank). Here each
projection's shrink and expand is timed on aphrodite's own ``_lora_shrink`` / ``_lora_expand`` (the config handed in
where they look it up), ten calls captured in a CUDA graph as the engine runs them, at the decode row counts, over a
small grid; a candidate whose output differs from the default's is dropped. The files hold the fastest config per
(num_slices, m, k, n), for num_slices 1 - 4 (a missing num_slices would be a KeyError in the engine), and the
default config at 1024 and 4096 rows (prefill).
The 27B's adapted projections (make-tiny's ``lora-mlp``: GDN in_proj_qkv / in_proj_z / out_proj, attention q/k/v /
o_proj, MLP gate/up / down; per step 48 GDN and 16 attention layers).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

HIDDEN, INTER = 5120, 17408
# (name, input k, output slices, layers per step)
PROJECTIONS = [
    ("gdn in_proj_qkv", HIDDEN, (2048, 2048, 6144), 48),
    ("gdn in_proj_z", HIDDEN, (6144,), 48),
    ("gdn out_proj", 6144, (HIDDEN,), 48),
    ("attn qkv_proj", HIDDEN, (12288, 1024, 1024), 16),
    ("attn o_proj", 6144, (HIDDEN,), 16),
    ("mlp gate_up_proj", HIDDEN, (INTER, INTER), 64),
    ("mlp down_proj", INTER, (HIDDEN,), 64),
]
ROWS = (1, 32, 8, 16, 64, 128, 256)  # tuned in this order: the LoRA table's levels (1, 32) first
PREFILL_ROWS = (1024, 4096)


def shrink_grid(m: int):
    for bm, bk, sk in itertools.product((16, 32), (64, 128, 256), (1, 4, 8, 16, 32)):
        if bm > max(16, m):
            continue
        yield {"block_m": bm, "block_n": 16, "block_k": bk, "split_k": sk, "num_warps": 4, "num_stages": 2}


def expand_grid(m: int):
    for bm, bn, nw in itertools.product((16, 32, 64), (64, 128, 256), (4, 8)):
        if bm > max(16, m):
            continue
        yield {"block_m": bm, "block_n": bn, "block_k": 16, "num_warps": nw, "num_stages": 2}


def graph_time(fn, torch, calls: int = 10, replays: int = 15) -> float:
    """µs per call: ``calls`` calls captured in one CUDA graph, replayed, the median replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return sorted(samples)[len(samples) // 2]


def tune(out: Path, rank: int, deadline: float) -> dict:
    import torch
    from aphrodite.lora.ops.triton_ops import lora_expand_op, lora_shrink_op, utils
    from aphrodite.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

    t0 = time.perf_counter()
    dev = torch.device("cuda:0")
    meta = LoRAKernelMeta.make(1, max(ROWS), dev)
    report = {"device": torch.cuda.get_device_name(), "rank": rank, "rows": [], "configs": {}}
    real_lookup = {m: m.get_lora_op_configs for m in (lora_shrink_op, lora_expand_op)}
    gen = torch.Generator(device=dev).manual_seed(0)
    try:
        for m, (name, k, slices, count) in itertools.product(ROWS, PROJECTIONS):
            if time.perf_counter() - t0 > deadline:
                print(f"lora_tune: deadline reached; {name} at {m} rows and after keep the default config")
                break
            meta.prepare_tensors(torch.zeros(m, dtype=torch.int32, device=dev))
            args = meta.meta_args(m, False)
            x = torch.randn(m, k, generator=gen, device=dev).half()
            a = [torch.randn(1, 1, rank, k, generator=gen, device=dev).half() * 0.02 for _ in slices]
            b = [torch.randn(1, 1, n, rank, generator=gen, device=dev).half() * 0.02 for n in slices]
            mid = torch.zeros(len(slices), m, rank, dtype=torch.float32, device=dev)
            y = torch.zeros(m, sum(slices), dtype=torch.float16, device=dev)
            for op, module, grid in (("shrink", lora_shrink_op, shrink_grid), ("expand", lora_expand_op, expand_grid)):
                default = utils.get_lora_op_configs(
                    op,
                    max_loras=2,
                    batch=m,
                    hidden_size=k if op == "shrink" else max(slices),
                    rank=rank,
                    num_slices=len(slices),
                    **({"add_inputs": True} if op == "expand" else {}),
                )

                def call(cfg, op=op, module=module):
                    module.get_lora_op_configs = lambda *_, **__: cfg
                    if op == "shrink":
                        module._lora_shrink(x, a, mid, *args, 1.0)
                        return mid
                    module._lora_expand(mid, b, y, *args, offset_start=0, add_inputs=True)
                    return y

                y.zero_()
                ref = call(default).clone()
                timed = {"default": graph_time(lambda: call(default), torch)}
                best, best_cfg = timed["default"], default
                for cand in grid(m):
                    cfg = {**default, **cand}
                    try:
                        y.zero_()
                        got = call(cfg)
                        if not torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=1e-3):
                            continue
                        t = graph_time(lambda cfg=cfg: call(cfg), torch)
                    except Exception as exc:  # noqa: BLE001 - a config Triton refuses is not a candidate
                        print(f"lora_tune: {op} {cand} refused: {type(exc).__name__}")
                        continue
                    if t < best:
                        best, best_cfg = t, cfg
                n_key = rank if op == "shrink" else max(slices)
                k_key = k if op == "shrink" else rank
                row = {
                    "name": name,
                    "op": op,
                    "m": m,
                    "k": k_key,
                    "n": n_key,
                    "num_slices": len(slices),
                    "count": count,
                    "default_us": timed["default"],
                    "tuned_us": best,
                    "config": best_cfg,
                }
                report["rows"].append(row)
                print(f"{name} {op} m={m}: default {timed['default']:.1f} us, tuned {best:.1f} us {best_cfg}")
    finally:
        for module, fn in real_lookup.items():
            module.get_lora_op_configs = fn
    report["seconds"] = round(time.perf_counter() - t0, 1)
    write_configs(report, out)
    return report


def write_configs(report: dict, out: Path) -> list[Path]:
    """The tuned files for this GPU, named as aphrodite looks them up, plus the measurement (lora_tune.json). Every
    num_slices 1 - 4 is present (a num_slices with no projection of its own copies the nearest measured one), and the
    prefill rows take aphrodite's own default."""
    import copy

    out.mkdir(parents=True, exist_ok=True)
    gpu = report["device"].replace(" ", "_").replace("-", "_")
    files = []
    for op, names in (("shrink", ["SHRINK"]), ("expand", ["EXPAND_TRUE", "EXPAND_FALSE"])):
        measured: dict = {}  # num_slices -> {m: {k: {n: config}}}
        for r in (r for r in report["rows"] if r["op"] == op):
            at = measured.setdefault(r["num_slices"], {}).setdefault(str(r["m"]), {}).setdefault(str(r["k"]), {})
            at[str(r["n"])] = r["config"]
        if not measured:
            continue
        table = {}
        for slices in range(1, 5):
            source = measured.get(slices) or measured[min(measured, key=lambda s: abs(s - slices))]
            entry = copy.deepcopy(source)
            shapes = {k: list(ns) for at in source.values() for k, ns in at.items()}
            for m in PREFILL_ROWS:
                entry[str(m)] = {k: dict.fromkeys(ns, prefill_default(op)) for k, ns in shapes.items()}
            table[str(slices)] = entry
        for name in names:
            path = out / f"{gpu}_{name}.json"
            path.write_text(json.dumps({"1": table, "2": table}, indent=1))
            files.append(path)
    (out / "lora_tune.json").write_text(json.dumps(report, indent=1))
    return files


def prefill_default(op: str) -> dict:
    """aphrodite 0.24's default for >= 128 rows (``get_lora_op_configs``)."""
    if op == "shrink":
        return {
            "block_m": 32,
            "block_n": 16,
            "block_k": 32,
            "split_k": 8,
            "num_warps": 4,
            "num_ctas": 1,
            "group_size_m": 8,
            "num_stages": 2,
            "max_nreg": None,
        }
    return {
        "block_m": 64,
        "block_n": 64,
        "block_k": 32,
        "num_warps": 4,
        "num_ctas": 1,
        "num_stages": 2,
        "max_nreg": None,
    }


def render(report: dict, out: Path, stem: str = "lora_tune") -> str:
    rows = report["rows"]
    lines = [
        f"# LoRA shrink/expand: default against tuned configs ({report['device']}, rank {report['rank']}; µs a "
        "call, ten calls in a CUDA graph, median of 15 replays; bench/lora_tune.py)",
        "",
        "| projection | op | rows | default µs | tuned µs | tuned / default | tuned config |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["config"]
        cfg = ", ".join(f"{k} {c[k]}" for k in ("block_m", "block_n", "block_k", "split_k", "num_warps") if k in c)
        lines.append(
            f"| {r['name']} | {r['op']} | {r['m']} | {r['default_us']:.1f} | {r['tuned_us']:.1f} | "
            f"{r['tuned_us'] / r['default_us']:.2f} | {cfg} |"
        )
    sums: dict = {}
    for r in rows:
        at = sums.setdefault(r["m"], [0.0, 0.0])
        at[0] += r["count"] * r["default_us"]
        at[1] += r["count"] * r["tuned_us"]
    lines += ["", "One decode step's shrink and expand kernels summed (48 GDN and 16 attention layers, every MLP):", ""]
    lines += ["| rows | default µs | tuned µs | saved µs |", "|---|---|---|---|"]
    lines += [f"| {m} | {d:.0f} | {t:.0f} | {d - t:.0f} |" for m, (d, t) in sorted(sums.items())]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--deadline", type=float, default=150.0, help="stop tuning after this many seconds")
    ap.add_argument("--report", type=Path, help="render this measurement's JSON into OUT (no GPU)")
    args = ap.parse_args()
    if args.report is not None:
        try:
            print(render(json.loads(args.report.read_text()), Path(args.out)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            sys.exit(f"lora_tune: cannot read {args.report}: {exc}")
        return
    report = tune(Path(args.out), args.rank, args.deadline)
    print(render(report, Path(args.out)))


if __name__ == "__main__":
    main()
