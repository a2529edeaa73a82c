"""Tables and a plot from bench/exl3_codebook_cache.py's output (runs anywhere; the plot needs
matplotlib): python bench/plot_p3.py bench/results  ->  p3_latency.md, p3_latency.png there."""

from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

from report import pyplot, write_table

PATHS = ["native", "p3_forced", "forced_best", "reconstruct"]


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
    rows = list(csv.DictReader(open(folder / "p3_latency.csv")))
    cells = defaultdict(dict)
    launches = {}
    for r in rows:
        key = (int(r["k"]), int(r["n"]), int(r["K"]), int(r["rows"]))
        cells[key][r["path"]] = float(r["us"])
        if r["path"] == "p3_forced":
            launches[key] = r["launch"]
    overhead = json.loads((folder / "p3_overhead.json").read_text())
    lines = [
        f"# P3 per-layer latency ({overhead['device']}; aphrodite-engine 0.21.0; median of triton do_bench, µs)",
        "",
        "`native`: aphrodite's cached small-batch path for the layer that owns its cache key (what P3 leaves "
        "alone); `p3_forced`: the uncached launch P3 gives a conflicting layer (shape/SMs in brackets); "
        "`forced_best`: the fastest uncached launch over every tiling shape and 1, 1/2, 1/4 of the SMs; "
        "`reconstruct`: P3's fallback when its probe finds the uncached launch wrong.",
        "",
        "| in x out | bits | rows | native | p3_forced | forced_best | reconstruct | p3_forced / native |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (k, n, K, m), c in sorted(cells.items()):
        lines.append(
            f"| {k} x {n} | {K} | {m} | {c['native']:.1f} | {c['p3_forced']:.1f} ({launches[(k, n, K, m)]}) | "
            f"{c['forced_best']:.1f} | {c['reconstruct']:.1f} | {c['p3_forced'] / c['native']:.2f} |"
        )
    ratios = sorted(c["p3_forced"] / c["native"] for c in cells.values())
    lines += [
        "",
        f"p3_forced / native: median {ratios[len(ratios) // 2]:.2f}, range {ratios[0]:.2f} to {ratios[-1]:.2f}.",
        "",
        "One-time costs (same run):",
        "",
        "- runtime probe, first call in a process that had not used the GPU yet: "
        f"{overhead['runtime_probe_ms']:.0f} ms",
        f"- load-time plan per EXL3 layer: {overhead['plan_us_per_layer_single_codebook']:.1f} µs (single-codebook "
        f"model), {overhead['plan_us_per_layer_mixed']:.1f} µs (mixed, half the layers routed, with logging)",
    ]
    write_table(folder / "p3_latency.md", lines)
    plt = pyplot()
    if plt is None:
        return
    shapes = sorted({(k, n, K) for k, n, K, _ in cells})
    fig, axes = plt.subplots(1, len(shapes), figsize=(2.6 * len(shapes), 3.6), sharey=True)
    for ax, (k, n, K) in zip(axes, shapes):
        ms = sorted(m for kk, nn, KK, m in cells if (kk, nn, KK) == (k, n, K))
        for path in PATHS:
            ax.plot(ms, [cells[(k, n, K, m)][path] for m in ms], marker="o", label=path)
        ax.set_title(f"{k}x{n}\n{K} bits", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows")
    axes[0].set_ylabel("µs per call")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"P3: conflicting-layer path vs native ({overhead['device']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(folder / "p3_latency.png", dpi=120)


if __name__ == "__main__":
    main()
