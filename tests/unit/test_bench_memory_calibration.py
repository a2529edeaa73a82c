"""bench/memory_calibration.py: the configurations issue 34's device session starts, and the start-up figures it
reads from both measurement styles (0.20-0.22 log the non-torch split, 0.23+ the free-memory drop)."""

from __future__ import annotations

import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import memory_calibration as cal  # noqa: E402


def test_issue_34s_rows_are_configurations_and_cover_what_it_asks_for():
    table = cal.configs(139.8)
    assert set(cal.ISSUE34) <= set(table)
    args = {name: table[name][2] for name in cal.ISSUE34}
    assert "--language-model-only" not in args["9b-24g-vision"]  # vision on, images in the profile

    def last(flag, row):  # the engine's argparse keeps a flag's last value
        a = args[row]
        return a[len(a) - a[::-1].index(flag)]

    assert (
        last("--max-num-batched-tokens", "9b-24g") == "2048"
        and last("--max-num-batched-tokens", "9b-24g-mnbt8192") == "8192"
    )
    assert last("--max-loras", "9b-24g-lora") == "4"  # more than one adapter slot
    assert table["27b-4layer-bf16-h200"][0].endswith("/dense")  # unquantized bfloat16 weights
    assert table["35b4-32g"][0] == "35b4/exl3" and "--enforce-eager" not in args["35b4-32g"]  # profiled, compiled
    # the 9B's rows share one checkpoint, written with the published vision tower
    assert {table[name][0] for name in cal.ISSUE34 if name.startswith("9b-")} == {"9b/exl3"}
    assert "qwen3.5-9b-full --vision published" in (ROOT / "ci" / "gpu-run.sh").read_text()


def test_start_up_figures_of_both_measurement_styles():
    old = (ROOT / "docs/gpu-runs/2026-12-01-run11/cal/9b-24g.log").read_text(errors="replace")
    assert cal.figures(old)["init_free_gib"] == 132.74 and cal.figures(old)["non_torch_gib"] == 0.27
    new = (
        "worker init memory snapshot: torch_peak=0.00GiB, torch_allocated=0.00GiB, free_memory=138.12GiB, "
        "total_memory=139.8GiB\nMemory profiling takes 3.10 seconds. Total non KV cache memory: 10.2GiB; torch peak "
        "memory increase: 2.1GiB; total consumed (from mem_get_info): 9.9GiB; weights memory: 7.6GiB."
    )  # aphrodite 0.24.1 utils/mem_utils.py MemorySnapshot / MemoryProfilingResult reprs
    got = cal.figures(new)
    assert (got["init_free_gib"], got["total_consumed_gib"], got["non_kv_gib"]) == (138.12, 9.9, 10.2)
    assert "non_torch_gib" not in got
