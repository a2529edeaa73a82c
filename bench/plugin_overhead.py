"""What the overlay adds to an aphrodite process's start (the goal: under 50 ms).

Each sample is a fresh Python process with the real aphrodite-engine modules (CPU is enough: the
plugin's work, imports and probes, runs on the CPU in every engine process). Two contexts:

- worker: the process already imported the modules the patches touch (as an engine-core or worker
  process has by the time it loads a model): cost = importing hybrid_exl3_fixes + apply_all().
- process0-quantized: process 0 serving a quantized model: it has imported aphrodite.engine.arg_utils
  and asked for the quantization config, as ModelConfig does (config/model.py:968 calls
  get_quantization_config, which imports every quantization config, .exl3 included); the plugin
  additionally imports the LoRA layers.
- process0-bare: a fresh process that has imported only aphrodite.engine.arg_utils: the cost then
  includes importing quantization/exl3.py for the probes.

Usage: PYTHONPATH=.cache/aphrodite/0.21.0 python bench/plugin_overhead.py [--runs 15] [--out bench/results]
Writes plugin_overhead.csv, plugin_overhead.md and plugin_overhead.png (if matplotlib is present).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from report import pyplot, write_table

CHILD = r"""
import json, sys, time
context = sys.argv[1]
if context == "worker":
    import aphrodite.lora.layers.base_linear
    import aphrodite.lora.layers.fused_moe
    import aphrodite.model_executor.layers.quantization.exl3
elif context == "process0-quantized":
    # get_quantization_config imports every quantization config module; .exl3 is the part that
    # matters here (the others need packages such as compressed-tensors this CPU setup lacks)
    import aphrodite.engine.arg_utils, aphrodite.model_executor.layers.quantization.exl3
else:
    import aphrodite.engine.arg_utils
t0 = time.perf_counter()
import hybrid_exl3_fixes
t1 = time.perf_counter()
results = hybrid_exl3_fixes.apply_all()
t2 = time.perf_counter()
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "apply_ms": (t2 - t1) * 1e3, "total_ms": (t2 - t0) * 1e3,
                  "statuses": [r.status.value for r in results]}))
"""


CONTEXTS = ("worker", "process0-quantized", "process0-bare")


def sample(context: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, context], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import importlib.metadata

    version = importlib.metadata.version("aphrodite-engine")
    rows = []
    for context in CONTEXTS:
        sample(context)  # warm the file cache
        for run in range(args.runs):
            rows.append(
                {"context": context, "run": run, **{k: v for k, v in sample(context).items() if k != "statuses"}}
            )
    with (out / "plugin_overhead.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    from hybrid_exl3_fixes.decisions.exl3_kernels import installed_kernel_libraries

    kernels = ", ".join(p.name for p in installed_kernel_libraries())
    lines = [
        f"# Plugin start overhead (aphrodite-engine {version}, CPU, {args.runs} fresh processes each)",
        "",
        f"Command: `PYTHONPATH={os.environ.get('PYTHONPATH', '')} python bench/plugin_overhead.py --runs {args.runs}`",
        "",
        f"Kernel library present (P3 reads its symbols): {kernels or 'no (P3 NOT_APPLICABLE)'}",
        "",
        "| context | median total (ms) | p90 total (ms) | median import (ms) | median apply_all (ms) | goal |",
        "|---|---|---|---|---|---|",
    ]
    for context in CONTEXTS:
        sel = [r for r in rows if r["context"] == context]
        totals = sorted(r["total_ms"] for r in sel)
        p90 = totals[int(0.9 * (len(totals) - 1))]
        med = statistics.median(totals)
        lines.append(
            f"| {context} | {med:.1f} | {p90:.1f} | {statistics.median(r['import_ms'] for r in sel):.1f} | "
            f"{statistics.median(r['apply_ms'] for r in sel):.1f} | {'met' if med < 50 else 'NOT met'} (< 50 ms) |"
        )
    write_table(out / "plugin_overhead.md", lines)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    data = [[r["total_ms"] for r in rows if r["context"] == c] for c in CONTEXTS]
    ax.boxplot(data, tick_labels=["worker", "process 0\n(quantized model)", "bare process 0\n(arg_utils only)"])
    ax.set_yscale("log")
    ax.axhline(50, color="red", linestyle="--", label="goal 50 ms")
    ax.set_ylabel("ms added by the plugin")
    ax.set_title(f"hybrid-exl3-fixes start overhead, aphrodite {version}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "plugin_overhead.png", dpi=120)


if __name__ == "__main__":
    main()
