"""bench/exl3_kernel_choice.py's report on a measurement of made-up times (a fake input: the GPU's numbers): the
per-kernel table and the step sums follow from P8's own decision, and a bad file gets a message, not a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import exl3_kernel_choice as bench  # noqa: E402


def fake_report() -> dict:
    rows = []
    for name, k, n, K, count, path in bench.PROJECTIONS:
        for r in (1, 8, 16, 32):
            row = {"name": name, "k": k, "n": n, "K": K, "count": count, "path": path, "rows": r, "native": 50.0}
            if path == "gemm":
                faster = name == "mlp down_proj"
                row |= {"heuristic": 40.0, "heuristic_launch": "3/132", "best": 40.0, "best_launch": "3/132"}
                row |= {"p8": 40.0 if faster else 50.0, "p8_launch": "3/132" if faster else "native"}
            rows.append(row)
    return {
        "device": "NVIDIA H200, 132 SMs, class hopper",
        "aphrodite": "0.21.0",
        "rounds": 15,
        "calls": 8,
        "rows": rows,
    }


def test_step_sums_count_each_projection_per_layer():
    sums = bench.step_sums(fake_report()["rows"])
    per_step = sum(count for *_, count, _ in bench.PROJECTIONS)  # 48 + 48 + 64 + 64 + 16 + 1 + 64 + 16
    assert sums[1]["native"] == 50.0 * per_step
    assert sums[1]["native"] - sums[1]["p8"] == 64 * 10.0  # only down_proj moved, in all 64 layers


def test_report_renders_the_tables(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(fake_report()))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "exl3_kernel_choice.py"), "--report", str(path), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "exl3_kernel_choice.md").read_text()
    assert "| mlp down_proj | 17408 x 5120 | 3 | 1 | 50.0 | 40.0 (3/132) | 40.0 (3/132) | 40.0 (3/132) | 0.80 |" in md
    assert "| head | 5120 x 248320 | 6 | 32 | 50.0 |" in md and "aphrodite's op" in md
    assert "| 1 | 16050 | 15410 | 640 | 4.0% |" in md
    assert (tmp_path / "exl3_kernel_choice.csv").read_text().count("\n") == 1 + len(fake_report()["rows"])


def test_a_bad_file_gets_a_message(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "exl3_kernel_choice.py"), "--report", str(bad), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "exl3_kernel_choice.md").exists()
