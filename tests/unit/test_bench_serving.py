"""bench/serving.py and bench/plot_serving.py without a GPU: the parts that turn engine output into
numbers and verdicts (the engines themselves run on the H200: bench/README.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import plot_serving  # noqa: E402
import serving  # noqa: E402


def test_summarise_takes_throughput_over_the_batch_and_decode_speed_per_request():
    times = [{"first": 0.1, "done": 1.1, "tokens": 128}, {"first": 0.2, "done": 2.2, "tokens": 128}]
    s = serving.summarise(times)
    assert s["wall_s"] == 2.2 and s["throughput_tok_s"] == round(256 / 2.2, 1)
    assert s["ttft_ms_mean"] == 150.0
    assert s["decode_tok_s_per_request"] == round((127 / 1.0 + 127 / 2.0) / 2, 1)
    assert s["tokens_short"] == 0
    assert serving.summarise([{"first": 0.1, "done": 1.0, "tokens": 5}])["tokens_short"] == 1


def test_engine_cases_per_experiment(tmp_path):
    names = [c["name"] for c in serving.engine_cases(tmp_path, {"codebooks"}, [256])]
    assert names == ["exl3", "exl3-mixed", "exl3-3inst", "exl3-mul1"]
    chunk = serving.engine_cases(tmp_path, {"chunk"}, [256, 4096])
    assert [(c["name"], c["max_num_batched_tokens"]) for c in chunk] == [("chunk-256", 256), ("chunk-4096", 4096)]
    assert all(c["model"] == str(tmp_path / "mcg" / "exl3") for c in chunk)


@pytest.mark.parametrize("args, message", [(["--only", "speed"], "unknown experiments"),
                                           ([], "no checkpoint in")])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, args, message):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(BENCH / "serving.py"), str(tmp_path), "--out", str(out), *args],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and message in proc.stderr
    assert not out.exists()


def row(engine, workload, n, throughput):
    return {"engine": engine, "workload": workload, "n": n, "wall_s": 1.0, "throughput_tok_s": throughput,
            "ttft_ms_mean": 20.0, "decode_tok_s_per_request": throughput / n, "tokens_short": 0, "error": ""}


def test_report_states_each_goal_against_its_baseline(tmp_path):
    results = {
        "exl3": [row("exl3", "no adapter", n, 100.0 * n) for n in (1, 32)],
        "exl3+lora": [row("exl3+lora", "one adapter", 1, 90.0), row("exl3+lora", "one adapter", 32, 2000.0)],
        "exl3-mixed": [row("exl3-mixed", "no adapter", 1, 95.0)],
        "exl3-3inst": [row("exl3-3inst", "no adapter", 1, 110.0)],
    }
    for name, rows in results.items():
        (tmp_path / f"result-{name}.json").write_text(json.dumps({"ok": True, "engine": name, "rows": rows,
                                                                 "enforce_eager": True}))
    (tmp_path / "result-exl3-mul1.json").write_text(json.dumps({"ok": False, "engine": "exl3-mul1", "rows": [],
                                                                "error": "engine died"}))
    serving.collect(tmp_path)
    lines = plot_serving.report(*plot_serving.load(tmp_path), "test")
    goals = {l.split(" | ")[0][2:]: l for l in lines if l.endswith(("| yes |", "| NO |"))}
    assert "| 10.0 % | < 15 % | yes |" in goals["LoRA overhead, one adapter, N = 1"]
    assert "| 37.5 % | < 15 % | NO |" in goals["LoRA overhead, one adapter, N = 32"]
    # the best native path at N = 1 is 3INST (110), not the mcg baseline (100): 95 / 110
    assert "| 0.86x | >= 0.90x | NO |" in goals["mixed-codebook model (P3) vs best native, N = 1"]
    errors = next(l for l in lines if l.startswith("| errors up to N = 32"))
    assert "1 failed engines" in errors and errors.endswith("| NO |")
    assert any(l.startswith("| exl3-mul1 | NO: engine died | — |") for l in lines)
