"""doctor's memory plan (overlay/memplan.py) against aphrodite's own start-up logs of runs 10 and 11
(committed under docs/gpu-runs/; bench/memory_plan_report.py builds the same table)."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import memory_plan_report as report  # noqa: E402

ROWS = report.rows()


@pytest.mark.parametrize("row", [r for r in ROWS if r["kind"] == "layout"], ids=lambda r: r["name"])
def test_kv_layout_matches_the_engine_exactly(row):
    """Pinned pools: block size, KV tokens and concurrency are the engine's arithmetic, to the token."""
    got = report.evaluate(row)
    for key in ("block_size", "kv_cache_tokens", "max_concurrency"):
        assert got[f"{key} ratio"] == 1.0, (key, got)


@pytest.mark.parametrize("row", [r for r in ROWS if r["kind"] == "pool"], ids=lambda r: r["name"])
def test_whole_plan_within_5_percent_of_the_logged_pool_and_capacity(row):
    got = report.evaluate(row)
    for key in ("available_kv_gib", "kv_cache_tokens"):
        assert got[f"{key} logged"], (key, got)
        assert abs(got[f"{key} ratio"] - 1) <= 0.05, (key, got)


def test_the_previous_plan_was_far_off_on_a_24g_card():
    """What doctor said before this plan (total x utilization - weights) for the 9B on a 24 GB card: 30 %
    above the pool the engine logged; the reason for issue 19."""
    row = next(r for r in ROWS if r["name"].startswith("9b-24g ("))
    weights = sum(t["bytes"] for n, t in row["tensors"].items() if ".visual." not in n)
    previous = (24 * 0.9 * report.GIB - weights) / report.GIB
    assert previous / report.logged(row["text"])["available_kv_gib"] > 1.25


def test_batch_defaults_follow_the_gpu_size():
    from hybrid_exl3_fixes.memplan import Engine, capture_sizes

    small, big = Engine(24), Engine(141)
    assert (small.max_num_batched_tokens, small.max_num_seqs) == (2048, 256)
    assert (big.max_num_batched_tokens, big.max_num_seqs) == (8192, 1024)
    piecewise, full = capture_sizes(small)
    assert (len(piecewise), piecewise[-1], len(full), full[-1]) == (51, 512, 35, 256)  # the 9B's log


def test_doctor_json_carries_every_term(tmp_path, capsys):
    from hybrid_exl3_fixes.cli import main
    from hybrid_exl3_fixes.exl3.tiny import TinySpec, write_tiny

    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    args = ["doctor", str(tmp_path / "t" / "exl3"), "--json", "--language-model-only", "--gpu-mem", "24"]
    main([*args, "--enable-lora", "--max-loras", "4", "--max-num-batched-tokens", "4096", "--enforce-eager"])
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert set(plan["terms"]) == {
        "requested",
        "weights",
        "lora_buffers",
        "load_overhead",
        "activation_peak",
        "non_torch",
        "cudagraphs",
    }
    assert plan["terms"]["lora_buffers"]["bytes"] > 0 and plan["terms"]["cudagraphs"]["bytes"] == 0
    assert plan["engine"]["max_num_batched_tokens"] == 4096 and plan["engine"]["enforce_eager"] is True
    assert plan["pin_kv_cache_memory"] == plan["kv_pool_bytes"] - 150 * (1 << 20)


def test_limit_mm_per_prompt_zero_is_text_only_and_bad_json_is_a_usage_error(tmp_path, capsys):
    from hybrid_exl3_fixes.cli import main
    from hybrid_exl3_fixes.exl3.tiny import TinySpec, write_tiny

    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    base = ["doctor", str(tmp_path / "t" / "exl3"), "--json", "--gpu-mem", "24"]

    def terms(*extra):
        main([*base, *extra])
        return json.loads(capsys.readouterr().out)["plan"]["terms"]

    assert "vision_encoder" in terms()
    assert terms("--limit-mm-per-prompt", '{"image": 0, "video": 0}') == terms("--language-model-only")
    assert "vision_encoder" in terms("--limit-mm-per-prompt", '{"image": 1}')
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--limit-mm-per-prompt", "[1]"])
    assert exit_info.value.code == 2 and "not a JSON object of modality -> count" in capsys.readouterr().err


def test_the_plan_counts_the_mamba_blocks_the_engine_refused_with():
    """Run 14: the 27B at full depth with its pool pinned at 16 GiB stopped with "max_num_seqs (1024) exceeds
    available Mamba cache blocks (655)" (docs/gpu-runs/2026-12-01-run14/fulldepth/try1-contended/); at 28 GiB it
    served (its layout row above)."""
    from hybrid_exl3_fixes import memplan

    inputs = json.loads(
        (ROOT / "docs/gpu-runs/2026-12-01-run12/fulldepth/inputs-qwen3.6-27b-full-exl3.json").read_text()
    )
    eng = memplan.Engine(139.8, max_model_len=832, language_model_only=True)
    layout = memplan.kv_layout(report.shape_of(inputs["config.json"]), eng)
    logged = ROOT / "docs/gpu-runs/2026-12-01-run14/fulldepth/try1-contended/qwen3.6-27b-full-aphrodite-base.stdout"
    assert "exceeds available Mamba cache blocks (655)" in logged.read_text()
    assert memplan.kv_capacity(layout, 16 << 30, 832)["blocks"] == 655 < eng.max_num_seqs


def test_doctor_blocks_a_pool_with_fewer_cache_blocks_than_sequences_under_cuda_graphs(tmp_path, capsys):
    from hybrid_exl3_fixes.cli import main
    from hybrid_exl3_fixes.exl3.tiny import TinySpec, write_tiny

    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    base = ["doctor", str(tmp_path / "t" / "exl3"), "--json", "--language-model-only", "--gpu-mem", "24"]

    def findings(*extra):
        main([*base, *extra])
        out = json.loads(capsys.readouterr().out)
        return [f for f in out["findings"] if f["check"] == "memory"], out["plan"]

    (ok,), plan = findings()
    assert ok["level"] == "OK" and plan["capacity"]["blocks"] >= plan["engine"]["max_num_seqs"]
    too_many = plan["capacity"]["blocks"] + 1
    (blocked,), plan = findings("--max-num-seqs", str(too_many))
    assert (
        blocked["level"] == "BLOCK" and f"max_num_seqs ({too_many}) exceeds available Mamba cache" in blocked["message"]
    )
    assert f"--max-num-seqs {plan['capacity']['blocks']} or less" in blocked["message"]
    assert plan["min_kv_cache_memory_for_graphs"] > plan["kv_pool_bytes"]
    (eager,), _ = findings("--max-num-seqs", str(too_many), "--enforce-eager")  # no graphs, no such check
    assert eager["level"] == "OK"
