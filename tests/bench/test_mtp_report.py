"""bench/mtp_report.py on same_run.py-shaped phases (fake input: the rows; the page, its ratios and acceptance are the
real code)."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import mtp_report  # noqa: E402

SPEC = """{"method":"mtp","num_speculative_tokens":2}"""
X3 = ["python3", "bench/exllamav3_generator.py", "m", "--serve", "--mtp", "2"]


def phase():
    variants = {
        "aphrodite-0.24": {"command": ["aphrodite", "run", "m"], "started": True, "state_dtype": "float32"},
        "aphrodite-0.24-mtp2": {"command": ["aphrodite", "run", "m", "--speculative-config", SPEC], "started": True},
        "exllamav3-fp32": {"command": X3, "started": True},
        "exllamav3-fp32-mtp2": {"command": [*X3, "(levels drafting 2)"], "started": True, "draft_tokens": 2},
    }
    speed = {"aphrodite-0.24": 100, "aphrodite-0.24-mtp2": 180, "exllamav3-fp32": 90, "exllamav3-fp32-mtp2": 150}
    runs = []
    for rep in range(5):
        for pool in ("a63", "a85"):
            for name, tok_s in speed.items():
                row = {"variant": name, "repeat": rep, "pool": pool, "concurrency": 1, "active": 1, "refused": []}
                row.update(per_request_tok_s=tok_s + rep, decode_tok_s=tok_s + rep)
                if name == "aphrodite-0.24-mtp2":
                    row["spec"] = {"drafts": 30, "draft_tokens": 60, "accepted_tokens": 36, "per_position": [0.8, 0.4]}
                if name == "exllamav3-fp32-mtp2":
                    row.update(draft_accepted=30, draft_rejected=20)
                runs.append(row)
    runs.append({"variant": "aphrodite-0.24", "repeat": 5, "pool": "a63", "concurrency": 1, "refused": ["3 of 1"]})
    return {"variants": variants, "runs": runs, "pools": {"a63": [0, 250], "a85": [250, 500]}, "formula": "f"}


def test_the_page_pairs_each_draft_size_with_exllamav3s_and_keeps_the_engines_acceptance(tmp_path):
    (tmp_path / "p1.json").write_text(json.dumps(phase()))
    manifest = {"mtp_acceptance": {"pools": [{"rate": 0.63, "tokens": [0, 250]}, {"rate": 0.85, "tokens": [250, 500]}]}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert (
        mtp_report.main(
            [str(tmp_path / "p1.json"), "--manifest", str(tmp_path / "manifest.json"), "--out", str(tmp_path)]
        )
        == 0
    )
    page = (tmp_path / "mtp_compare.md").read_text()
    rows = {(r["variant"], r["rate"]): r for r in mtp_report.table([phase()], {"a63": 0.63, "a85": 0.85})}
    mtp = rows["aphrodite-0.24-mtp2", 0.63]
    assert mtp["draft"] == 2 and mtp["repeats"] == 5 and mtp["exllamav3"] == "exllamav3-fp32-mtp2"
    assert mtp["acceptance"] == 0.6 and mtp["per_position"] == "0.8 / 0.4"
    assert mtp["acceptance_expected"] == round((0.63 + 0.63**2) / 2, 4)
    assert mtp["over_exllamav3"] == round(182 / 152, 3) and mtp["over_no_mtp"] == round(182 / 102, 3)
    assert rows["exllamav3-fp32-mtp2", 0.85]["acceptance"] == 0.6 and rows["exllamav3-fp32", 0.85]["draft"] == 0
    assert rows["aphrodite-0.24", 0.63]["over_exllamav3"] == round(102 / 92, 3)  # no MTP over exllamav3 drafting none
    assert "Refused levels" in page and "3 of 1" in page and "goal 1.1" in page


def test_a_bad_run_file_is_one_line(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{}")
    (tmp_path / "m.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        mtp_report.main([str(tmp_path / "bad.json"), "--manifest", str(tmp_path / "m.json"), "--out", str(tmp_path)])
    assert e.value.code == 2 and "cannot read the runs" in capsys.readouterr().err
