"""bench/memory_calibration.py: the configurations a calibration run starts, and the start-up figures it
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
    import memory_plan_report as report

    old = report.read_log(ROOT / "docs/gpu-runs/2026-12-01-run11/cal/9b-24g.log")
    assert cal.figures(old)["init_free_gib"] == 132.74 and cal.figures(old)["non_torch_gib"] == 0.27
    new = (
        "worker init memory snapshot: torch_peak=0.00GiB, torch_allocated=0.00GiB, free_memory=138.12GiB, "
        "total_memory=139.8GiB\nMemory profiling takes 3.10 seconds. Total non KV cache memory: 10.2GiB; torch peak "
        "memory increase: 2.1GiB; total consumed (from mem_get_info): 9.9GiB; weights memory: 7.6GiB."
    )  # aphrodite 0.24.1 utils/mem_utils.py MemorySnapshot / MemoryProfilingResult reprs
    got = cal.figures(new)
    assert (got["init_free_gib"], got["total_consumed_gib"], got["non_kv_gib"]) == (138.12, 9.9, 10.2)
    assert "non_torch_gib" not in got


def test_a_calibration_runs_rows_plan_the_flags_its_commands_gave():
    """bench/memory_plan_report.cal_rows on run 11's two 9B starts: the engine planned from each command and the
    logged total is the one the hand-written rows give (24 GB card emulated at utilization 0.9, 2,048 batched tokens,
    256 sequences, LoRA with 4 slots of rank 16), and so is the predicted pool."""
    import memory_plan_report as report

    rows = {r["name"].split(" ")[0]: r for r in report.cal_rows(ROOT / "docs/gpu-runs/2026-12-01-run11/cal", "0.21.0")}
    assert set(rows) == {"9b-24g", "9b-24g-lora"}
    by_hand = {r["name"].split(" ")[0]: r for r in report.rows() if r["name"].startswith("9b-24g (aphrodite run")}
    by_hand |= {r["name"].split(" ")[0]: r for r in report.rows() if r["name"].startswith("9b-24g-lora (aphrodite run")}
    for name, row in rows.items():
        eng, hand = row["engine"], by_hand[name]["engine"]
        assert abs(eng.gpu_gib * eng.utilization - hand.gpu_gib * hand.utilization) < 0.01
        assert (eng.max_num_batched_tokens, eng.max_num_seqs, eng.lora, eng.language_model_only) == (
            2048,
            256,
            name.endswith("lora"),
            True,
        )
        assert eng.max_loras == (4 if eng.lora else 1) and eng.max_model_len == 32768
        got, want = report.evaluate(row), report.evaluate(by_hand[name])
        assert abs(got["available_kv_gib predicted"] - want["available_kv_gib predicted"]) <= 0.01


def test_the_command_parser_reads_the_flags_doctor_plans():
    eng = cal.engine_from_command(
        ["run", "m", "--max-model-len", "65536", "--limit-mm-per-prompt", '{"image": 3}', "--max-num-seqs", "8",
         "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8", "--enforce-eager", "--tensor-parallel-size", "4"],
        23.5,
        "0.24.1",
    )  # fmt: skip
    assert (eng.max_model_len, eng.image_limit, eng.max_num_seqs, eng.prefix_caching, eng.kv_dtype) == (
        65536,
        3,
        8,
        False,
        "fp8",
    )
    assert eng.eager and eng.tp == 4 and eng.release == "0.24.1" and eng.utilization == 0.92
    text_only = cal.engine_from_command(["--limit-mm-per-prompt", '{"image": 0, "video": 0}'], 24, "0.24.1")
    assert text_only.language_model_only
