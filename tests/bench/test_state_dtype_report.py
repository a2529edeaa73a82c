"""bench/state_dtype_report.py on run 19's real results (docs/gpu-runs/2026-12-03-run19/state-dtype: the 27B at
full depth with the config's float32 GDN state beside --mamba-ssm-cache-dtype bfloat16, on one H200)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import state_dtype_report  # noqa: E402

RUN = ROOT / "docs" / "gpu-runs" / "2026-12-03-run19" / "state-dtype"
BANDWIDTH = ROOT / "docs" / "gpu-runs" / "2026-12-01-run14" / "fulldepth" / "bandwidth.json"


def report(tmp_path, run=RUN / "qwen3.6-27b-full.json"):
    args = [str(run), "--inputs", str(RUN / "inputs-qwen3.6-27b-full-exl3.json"), "--bandwidth-file", str(BANDWIDTH)]
    assert state_dtype_report.main([*args, "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "state_dtype.csv")))
    return {(r["variant"], int(r["concurrency"])): r for r in rows}, (tmp_path / "state_dtype.md").read_text()


def test_each_variant_gets_its_own_state_bytes_and_the_run_its_medians(tmp_path):
    rows, md = report(tmp_path)
    assert len(rows) == 8 and all(r["repeats"] == "3" for r in rows.values())
    f32, bf16 = rows[("float32-state", 32)], rows[("bf16-state", 32)]
    assert (f32["state_dtype"], bf16["state_dtype"]) == ("float32", "bfloat16")
    # the recurrent state halves; the conv state (in the activations' dtype) does not
    assert 0.5 < float(bf16["state_gb_per_step"]) / float(f32["state_gb_per_step"]) < 0.52
    assert float(f32["roofline_tok_s"]) < float(bf16["roofline_tok_s"])
    assert (float(f32["per_request_tok_s"]), float(bf16["per_request_tok_s"])) == (24.4, 25.5)
    assert "- N = 32: per-request 1.045, decode 1.128 (repeat 0: 1.021)" in md
    assert "| float32-state | the config's mamba_ssm_dtype | 784 | 60840 | 73.12 |" in md
    assert "At N = 128 the float32-state pool holds 73.12" in md and "At N = 128 the bf16-state" not in md


def test_a_run_before_level_seed_is_flagged_and_a_later_one_not(tmp_path):
    _, md = report(tmp_path / "a")
    assert "**Prompts**: this run sent the same seeded prompts" in md
    later = json.loads((RUN / "qwen3.6-27b-full.json").read_text())
    later["prompts"] = "seeded by level_seed(concurrency, repeat)"
    (tmp_path / "later.json").write_text(json.dumps(later))
    _, md = report(tmp_path / "b", tmp_path / "later.json")
    assert "**Prompts**" not in md


@pytest.mark.parametrize("content", [None, "{not json", json.dumps({"summary": {"x": {"1": None}}})])
def test_bad_input_is_refused_in_one_line_and_writes_nothing(tmp_path, content):
    run = tmp_path / "run.json"
    if content is not None:
        run.write_text(content)
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "state_dtype_report.py"), str(run), "--inputs"]
    cmd += [str(RUN / "inputs-qwen3.6-27b-full-exl3.json"), "--bandwidth-file", str(BANDWIDTH), "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "state_dtype_report.py: error:" in p.stderr
    assert not out.exists()


def test_notes_go_under_the_title_and_a_stem_names_the_files(tmp_path):
    args = [str(RUN / "qwen3.6-27b-full.json"), "--inputs", str(RUN / "inputs-qwen3.6-27b-full-exl3.json")]
    args += ["--bandwidth-file", str(BANDWIDTH), "--out", str(tmp_path), "--note", "Said here.", "--stem", "sd-run19"]
    assert state_dtype_report.main(args) == 0
    names = {p.name for p in tmp_path.iterdir()}  # the plot too where matplotlib is installed
    assert {"sd-run19.csv", "sd-run19.md"} <= names <= {"sd-run19.csv", "sd-run19.md", "sd-run19.png"}
    md = (tmp_path / "sd-run19.md").read_text().splitlines()
    assert md[0].startswith("# GDN state dtype: ") and md[1:4] == ["", "Said here.", ""]
    assert md[4].startswith("| variant")
