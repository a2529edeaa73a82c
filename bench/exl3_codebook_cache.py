"""P3's cost on a GPU: per-layer latency of the path a conflicting layer takes against aphrodite's
native cached path, at 1, 8 and 32 rows, for Qwen3.5/3.6-27B projection shapes; and the one-time
costs (the runtime probe, the load-time plan).

Run on the GPU machine (aphrodite 0.21.0 and this project importable):
    python3 bench/exl3_codebook_cache.py --out DIR
Writes DIR/p3_latency.csv, DIR/p3_overhead.json and prints a markdown table.
bench/plot_p3.py turns the CSV into results/p3_latency.{md,png}.

Paths (each measured with triton's do_bench, median of its repetitions, CUDA graphs off):
  native        aphrodite's exl3_linear_one; the layer owns its cache key (what P3 leaves alone)
  p3_forced     the overlay's op with P3's forced launch (shape heuristic, one block per tile up
                to one per SM) -- what a conflicting layer runs at <= 32 rows
  forced_best   the fastest forced launch over every tiling shape and a few SM counts (how far
                P3's heuristic is from the best uncached launch)
  reconstruct   the overlay's op with shape 0: decode the whole weight, then hgemm (P3's fallback
                when the probe finds the forced launch wrong)
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

SHAPES = [(5120, 17408), (17408, 5120), (5120, 10240), (6144, 5120)]  # gate/up, down, GDN qkv, o_proj
BITS = [3, 4]
ROWS = [1, 8, 32]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--codebook", default="mul1", help="the conflicting layer's codebook (the owner runs mcg)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import aphrodite.model_executor.layers.quantization.exl3 as exl3
    import torch
    from triton.testing import do_bench

    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p3_gemm_cache as p13
    from hybrid_exl3_fixes.checkpoint import codec
    from hybrid_exl3_fixes.decisions import exl3_kernels as kernels

    dev = torch.device("cuda:0")
    overhead = {}
    t = time.perf_counter()
    verdict, cc, sms = p13.device_verdict(dev)
    overhead["runtime_probe_ms"] = (time.perf_counter() - t) * 1e3
    overhead["probe_verdict"] = {
        "codebook_blind": verdict.codebook_blind,
        "forced_ok": verdict.forced_ok,
        "detail": verdict.detail,
    }
    props = torch.cuda.get_device_properties(0)
    overhead["device"] = f"{props.name}, {sms} SMs, class {cc}"

    flags = p13.CODEBOOK_FLAGS
    linear = torch.ops.aphrodite.exl3_linear_one
    routed = p13.routed_linear()
    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for k, n in SHAPES:
        for K in BITS:
            base = codec.random_exl3_linear(k, n, K, "3inst", gen)
            trellis, suh, svh = (base[name].to(dev) for name in ("trellis", "suh", "svh"))
            cb = flags[args.codebook]
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen).to(torch.float16).to(dev)
                linear(x, trellis, suh, svh, *flags["mcg"])  # the owner sets the cache entry
                timings = {"native": lambda: linear(x, trellis, suh, svh, *flags["mcg"])}
                launch = kernels.forced_launch(cc, k, n, K, sms)
                timings["p3_forced"] = lambda launch=launch: routed(x, trellis, suh, svh, *cb, *launch)
                timings["reconstruct"] = lambda: routed(x, trellis, suh, svh, *cb, 0, 0)
                result = {name: do_bench(fn, warmup=20, rep=100, quantiles=[0.5]) * 1e3 for name, fn in timings.items()}
                sweep = {}
                for shape_idx in range(1, 5):
                    if not kernels.shape_fits(shape_idx, k, n):
                        continue
                    slices = (k // kernels.TILE_K[shape_idx]) * (n // kernels.TILE_N[shape_idx])
                    for frac in (1.0, 0.5, 0.25):
                        num = max(1, min(slices, int(sms * frac)))
                        sweep[f"{shape_idx}/{num}"] = (
                            do_bench(
                                lambda s=shape_idx, m=num: routed(x, trellis, suh, svh, *cb, s, m),
                                warmup=10,
                                rep=50,
                                quantiles=[0.5],
                            )
                            * 1e3
                        )
                best = min(sweep, key=sweep.get)
                result["forced_best"] = sweep[best]
                for path, us in result.items():
                    rows_out.append(
                        {
                            "k": k,
                            "n": n,
                            "K": K,
                            "rows": rows,
                            "path": path,
                            "us": round(us, 2),
                            "launch": {"p3_forced": f"{launch[0]}/{launch[1]}", "forced_best": best}.get(path, ""),
                        }
                    )
                print(
                    f"{k}x{n} K={K} rows={rows}: "
                    + ", ".join(f"{p}={v:.1f}us" for p, v in result.items())
                    + f" (p3 launch {launch[0]}/{launch[1]}, best {best})",
                    flush=True,
                )

    # the load-time plan: CPU work per loaded layer once the probe's verdict is cached
    layers = []
    for i in range(64):
        method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0))
        layer = torch.nn.Module()
        layer.prefix, layer.exl3_shard_ids, layer.exl3_can_mgemm = f"model.layers.{i}.mlp.down_proj", [None], False
        for name in ("trellis", "mcg", "mul1"):
            param = exl3.Exl3Parameter.__new__(exl3.Exl3Parameter, weight_loader=exl3._exl3_weight_loader)
            param.exl3_tensors = {}
            layer.register_parameter(name, param)
        layer.trellis.exl3_tensors[None] = torch.empty(1088, 320, 64, dtype=torch.int16, device=dev)
        (layer.mcg if i % 2 else layer.mul1).exl3_tensors[None] = torch.empty((), dtype=torch.int32)
        layers.append((method, layer))
    t = time.perf_counter()
    for method, layer in layers:
        p13.plan_layer(method, layer)
    overhead["plan_us_per_layer_mixed"] = (time.perf_counter() - t) / len(layers) * 1e6
    single = []
    for i in range(64):
        method, layer = layers[i]
        layer.mcg.exl3_tensors.clear(), layer.mul1.exl3_tensors.clear()
        layer.trellis.exl3_tensors[None] = torch.empty(1088, 320, 48, dtype=torch.int16, device=dev)
        single.append((exl3.Exl3LinearMethod(exl3.Exl3Config(bits=3.0)), layer))
    t = time.perf_counter()
    for method, layer in single:
        p13.plan_layer(method, layer)
    overhead["plan_us_per_layer_single_codebook"] = (time.perf_counter() - t) / len(single) * 1e6

    with open(out / "p3_latency.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows_out[0]))
        w.writeheader()
        w.writerows(rows_out)
    (out / "p3_overhead.json").write_text(json.dumps(overhead, indent=2))
    print(json.dumps(overhead, indent=2))
    ratios = [r["us"] for r in rows_out if r["path"] == "p3_forced"]
    natives = [r["us"] for r in rows_out if r["path"] == "native"]
    print("median p3_forced / native:", statistics.median(a / b for a, b in zip(ratios, natives)))


if __name__ == "__main__":
    main()
