"""P12 per kernel: every EXL3 projection of one Qwen3.6-27B decode step at 1 - 256 rows on aphrodite's path, the
forced rebuild and a kept float16 weight, with each option's memory; and the step times those sum to.

    python3 bench/exl3_mid_batch.py --out DIR          # on the GPU machine, aphrodite 0.24+ importable
    python3 bench/exl3_mid_batch.py --report DIR/exl3_mid_batch.json --out bench/results   # anywhere

Each projection is a real ``Exl3LinearMethod`` layer (its own ``process_weights_after_loading``, so the fused gate/up
and k/v pairs take aphrodite's ``exl3_gate_up`` / ``exl3_qkv`` ops) on random EXL3 weights of the 27B's shape and
bits (mcg, as make-tiny and exllamav3 write them). Paths, timed by P12's own measurement
(``p12_mid_batch.measure_paths``: CUDA events, rounds of calls, paths interleaved, median) with more rounds:
``native`` aphrodite's (the tiled GEMM up to 0.24's 144 rows, the rebuild above), ``rebuild`` aphrodite's own rebuild
at every row count, ``kept`` one GEMM on the layer's float16 weight (``W = apply(I)``). ``P12`` is what P12 picks from
these times without the opt-in (native or rebuild, 3 % margin); ``P12 + keep`` with it (any path).
The step sum: 48 GDN layers (in_proj_qkv, in_proj_z, gate/up, out_proj, down), 16 attention layers (q/k/v, o_proj,
gate/up, down) and the head, per row count (the GEMMs only: the step also runs attention, the GDN recurrence, norms
and sampling). Memory: ``kept`` holds ``2 x in x out`` bytes per layer for the whole run; the rebuild allocates one
layer's float16 weight (at most 32768 columns of it) for the call, which aphrodite's own rebuild above 144 rows needs
already.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

HIDDEN, INTER, HEAD_VOCAB = 5120, 17408, 248320
ROWS = (1, 16, 32, 48, 64, 96, 128, 144, 192, 256)
# (name, prefix, {shard: (k, n)}, bits, layers using it per step): the 27B's projections (overlay/checkpoint/stream.py)
PROJECTIONS = [
    ("gdn in_proj_qkv", "model.layers.0.linear_attn.in_proj_qkv", {None: (HIDDEN, 10240)}, 3, 48),
    ("gdn in_proj_z", "model.layers.0.linear_attn.in_proj_z", {None: (HIDDEN, 6144)}, 3, 48),
    ("gdn out_proj / attn o_proj", "model.layers.0.linear_attn.out_proj", {None: (6144, HIDDEN)}, 3, 64),
    ("mlp down_proj", "model.layers.0.mlp.down_proj", {None: (INTER, HIDDEN)}, 3, 64),
    ("mlp gate/up (exl3_gate_up)", "model.layers.0.mlp.gate_up_proj", {0: (HIDDEN, INTER), 1: (HIDDEN, INTER)}, 3, 64),
    (
        "attn q/k/v (exl3_qkv)",
        "model.layers.3.self_attn.qkv_proj",
        {"q": (HIDDEN, 12288), "k": (HIDDEN, 1024), "v": (HIDDEN, 1024)},
        3,
        16,
    ),
    ("head", "lm_head", {None: (HIDDEN, HEAD_VOCAB)}, 6, 1),
]
PATHS = ("native", "rebuild", "kept")


def layer_of(exl3, prefix, shards, K, gen, torch, codec):
    """A loaded EXL3 linear layer (TP = 1) as ``create_weights`` and the loader leave it, then aphrodite's own
    ``process_weights_after_loading``. Random trellis words are a valid K-bit stream; signs scaled as make-tiny's."""
    from exl3_kernel_choice import random_layer

    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=float(K)))
    layer = torch.nn.Module()
    layer.prefix = prefix
    k = next(iter(shards.values()))[0]
    outs = [n for _, n in shards.values()]
    layer.exl3_tp_rank, layer.exl3_tp_size = 0, 1
    layer.exl3_input_size = layer.input_size_per_partition = k
    layer.exl3_output_size, layer.exl3_output_partition_sizes = sum(outs), outs
    layer.exl3_shard_ids = list(shards)
    layer.exl3_parallel_mode = "column"
    for name in ("suh", "svh", "trellis", "mcg", "mul1"):
        param = exl3.Exl3Parameter.__new__(exl3.Exl3Parameter, weight_loader=exl3._exl3_weight_loader)
        param.exl3_tensors = {}
        layer.register_parameter(name, param)
    dev = torch.device("cuda:0")
    for shard, (kk, n) in shards.items():
        for name, tensor in random_layer(kk, n, K, gen, dev, torch, codec).items():
            exl3._exl3_weight_loader(getattr(layer, name), tensor, shard)
        for name, tensor in codec.marker_tensors("mcg").items():
            exl3._exl3_weight_loader(getattr(layer, name), tensor.to(dev), shard)
    exl3.Exl3LinearMethod.process_weights_after_loading(method, layer)
    return method, layer


def measure(out: Path, rounds: int, only: list[str]) -> None:
    import aphrodite.model_executor.layers.quantization.exl3 as exl3
    import torch

    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p12_mid_batch as p12
    from hybrid_exl3_fixes.checkpoint import codec
    from hybrid_exl3_fixes.decisions import p12_mid_batch as midbatch

    p12.ROUNDS = rounds
    midbatch_rows = midbatch.ROW_STEPS
    midbatch.ROW_STEPS = ROWS  # this bench's rows (P12 itself decides at its own steps)
    props = torch.cuda.get_device_properties(0)
    gen = torch.Generator().manual_seed(0)
    import aphrodite

    report = {
        "device": f"{props.name}, {props.multi_processor_count} SMs",
        "aphrodite": aphrodite.__version__,
        "threshold": getattr(exl3, p12.THRESHOLD, None),
        "rounds": rounds,
        "calls": p12.CALLS,
        "rows": [],
    }
    try:
        for name, prefix, shards, K, count in PROJECTIONS:
            if only and not any(name.startswith(o) for o in only):
                continue
            t0 = time.perf_counter()
            method, layer = layer_of(exl3, prefix, shards, K, gen, torch, codec)
            k = next(iter(shards.values()))[0]
            n = sum(nn for _, nn in shards.values())
            weight = p12.effective_weight(method, layer, k, n, torch.device("cuda:0"))
            reference = method.apply(layer, weight.new_ones(4, k) / k).float()
            error = float(((weight.new_ones(4, k) / k) @ weight - reference).float().norm() / reference.norm())
            times = p12.measure_paths(method, layer, weight)
            for rows, at in times.items():
                report["rows"].append(
                    {"name": name, "k": k, "n": n, "K": K, "count": count, "rows": rows, **at, "kept_error": error}
                )
            print(f"{name}: {time.perf_counter() - t0:.1f} s; kept relative error {error:.1e}; " + describe(times))
            out.mkdir(parents=True, exist_ok=True)
            (out / "exl3_mid_batch.json").write_text(json.dumps(report, indent=1))
            del method, layer, weight
            torch.cuda.empty_cache()
    finally:
        midbatch.ROW_STEPS = midbatch_rows


def describe(times) -> str:
    return "; ".join(f"{r}: " + "/".join(f"{at.get(p, 0):.0f}" for p in PATHS) for r, at in sorted(times.items()))


def picks(at: dict, keep: bool, margin: float = 0.03) -> float:
    """The time of the path P12 takes from these times: native unless another beats it by more than ``margin``."""
    others = [at[p] for p in (("rebuild", "kept") if keep else ("rebuild",)) if at.get(p) is not None]
    best = min(others) if others else at["native"]
    return best if best < at["native"] * (1 - margin) else at["native"]


def step_sums(rows: list[dict]) -> dict[int, dict[str, float]]:
    """Per row count, the GEMMs of one step summed (µs) on each path and on P12's picks."""
    sums: dict[int, dict[str, float]] = {}
    for r in rows:
        at = sums.setdefault(r["rows"], dict.fromkeys((*PATHS, "p12", "p12_keep"), 0.0))
        for p in PATHS:
            at[p] += r["count"] * r[p]
        at["p12"] += r["count"] * picks(r, keep=False)
        at["p12_keep"] += r["count"] * picks(r, keep=True)
    return sums


def kept_bytes(rows: list[dict]) -> int:
    seen = {(r["name"], r["k"], r["n"], r["count"]) for r in rows}
    return sum(2 * k * n * count for _, k, n, count in seen)


def render(report: dict, out: Path, stem: str = "exl3_mid_batch") -> str:
    from exl3_kernel_choice import md_table

    rows = report["rows"]
    out.mkdir(parents=True, exist_ok=True)
    fields = ["name", "k", "n", "K", "count", "rows", *PATHS, "kept_error"]
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    table = [
        [
            r["name"],
            f"{r['k']} x {r['n']}",
            r["K"],
            r["rows"],
            *(f"{r[p]:.1f}" for p in PATHS),
            f"{picks(r, False) / r['native']:.2f}",
            f"{picks(r, True) / r['native']:.2f}",
        ]
        for r in rows
    ]
    sums = step_sums(rows)
    gib = kept_bytes(rows) / 2**30
    lines = [
        f"# P12 per kernel: the Qwen3.6-27B's EXL3 projections at 1 - 256 rows ({report['device']}; aphrodite-engine "
        f"{report['aphrodite']}, threshold {report['threshold']} rows; µs, median of {report['rounds']} rounds of "
        f"{report['calls']} calls)",
        "",
        "Real `Exl3LinearMethod` layers on random EXL3 weights (mcg) of each projection's shape and bits "
        "(bench/exl3_mid_batch.py). `native`: aphrodite's path (tiled GEMM up to the threshold, the rebuild above); "
        "`rebuild`: the float16 weight rebuilt for the call, at every row count; `kept`: one GEMM on a float16 weight "
        "kept from load. `P12`: what P12 takes without the opt-in (3 % margin), `P12 + keep` with it.",
        "",
    ]
    lines += md_table(
        ["projection", "k x n", "bits", "rows", "native", "rebuild", "kept", "P12 / native", "P12 + keep / native"],
        table,
    )
    lines += [
        "",
        "The GEMMs of one decode step summed (48 GDN + 16 attention layers and the head), with each option's memory "
        "beyond the EXL3 weights: native and P12 none (the rebuild's transient float16 weight, one layer at a time, "
        f"is what aphrodite's own rebuild above the threshold allocates); kept {gib:.1f} GiB for the whole run.",
        "",
    ]
    lines += md_table(
        ["rows", "native µs", "rebuild µs", "kept µs", "P12 µs", "P12 / native", "P12 + keep µs", "+ keep / native"],
        [
            [
                n,
                f"{s['native']:.0f}",
                f"{s['rebuild']:.0f}",
                f"{s['kept']:.0f}",
                f"{s['p12']:.0f}",
                f"{s['p12'] / s['native']:.2f}",
                f"{s['p12_keep']:.0f}",
                f"{s['p12_keep'] / s['native']:.2f}",
            ]
            for n, s in sorted(sums.items())
        ],
    )
    text = "\n".join(lines) + "\n"
    (out / f"{stem}.md").write_text(text)
    return text


def main() -> None:
    from exl3_kernel_choice import bench_main

    bench_main(__doc__, "exl3_mid_batch", measure, render, 9)


if __name__ == "__main__":
    main()
