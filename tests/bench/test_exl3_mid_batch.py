"""bench/exl3_mid_batch.py's and bench/lora_tune.py's reports on made-up measurements (a fake input: the GPU's
numbers): the step sums follow P12's own choice, the tuned LoRA files are found by aphrodite 0.24's own lookup for
every num_slices and row count the engine asks, and a bad file gets a message, not a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import APHRODITE_VERSION, ROOT

sys.path.insert(0, str(ROOT / "bench"))
import exl3_mid_batch as mid  # noqa: E402
import lora_tune  # noqa: E402


def mid_report() -> dict:
    rows = []
    for name, _, shards, K, count in mid.PROJECTIONS:
        k = next(iter(shards.values()))[0]
        n = sum(nn for _, nn in shards.values())
        for r in mid.ROWS:
            native = 60.0 * -(-r // 16) if r <= 144 else 150.0
            rows.append(
                {"name": name, "k": k, "n": n, "K": K, "count": count, "rows": r, "native": native,
                 "rebuild": 150.0, "kept": 40.0, "kept_error": 1e-3}
            )  # fmt: skip
    return {"device": "NVIDIA H200, 132 SMs", "aphrodite": "0.24.1", "threshold": 144, "rounds": 9, "calls": 4,
            "rows": rows}  # fmt: skip


def test_mid_batch_step_sums_follow_p12s_choice(tmp_path):
    report = mid_report()
    sums = mid.step_sums(report["rows"])
    per_step = sum(count for *_, count in mid.PROJECTIONS)
    assert sums[32]["p12"] == pytest.approx(120.0 * per_step)  # two tiles beat the rebuild
    assert sums[64]["p12"] == pytest.approx(150.0 * per_step)  # the rebuild beats four tiles
    assert sums[64]["p12_keep"] == pytest.approx(40.0 * per_step)
    text = mid.render(report, tmp_path)
    assert "| 64 | " in text and (tmp_path / "exl3_mid_batch.csv").exists()
    gib = mid.kept_bytes(report["rows"]) / 2**30
    assert f"kept {gib:.1f} GiB" in text and 40 < gib < 60  # the 27B's float16 projections and head


def test_mid_batch_report_of_a_bad_file_is_a_message(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "exl3_mid_batch.py"), "--report", str(bad), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr


def tune_report() -> dict:
    rows = []
    for name, k, slices, count in lora_tune.PROJECTIONS:
        for m in lora_tune.ROWS:
            for op in ("shrink", "expand"):
                cfg = {
                    "block_m": 16,
                    "block_n": 16 if op == "shrink" else 64,
                    "block_k": 64,
                    "num_warps": 4,
                    "num_stages": 2,
                    "num_ctas": 1,
                    "max_nreg": None,
                    **({"split_k": 4} if op == "shrink" else {}),
                }
                rows.append(
                    {"name": name, "op": op, "m": m, "k": k if op == "shrink" else 8,
                     "n": 8 if op == "shrink" else max(slices), "num_slices": len(slices), "count": count,
                     "default_us": 10.0, "tuned_us": 6.0, "config": cfg}
                )  # fmt: skip
    return {"device": "NVIDIA H200", "rank": 8, "rows": rows, "configs": {}}


def test_tuned_files_cover_every_slice_count_and_row_count(tmp_path):
    files = lora_tune.write_configs(tune_report(), tmp_path)
    assert sorted(f.name for f in files) == [
        "NVIDIA_H200_EXPAND_FALSE.json",
        "NVIDIA_H200_EXPAND_TRUE.json",
        "NVIDIA_H200_SHRINK.json",
    ]
    shrink = json.loads((tmp_path / "NVIDIA_H200_SHRINK.json").read_text())
    assert set(shrink) == {"1", "2"} and set(shrink["2"]) == {"1", "2", "3", "4"}
    assert shrink["2"]["4"]["1024"]["5120"]["8"]["block_k"] == 32  # prefill: aphrodite's own default
    assert shrink["2"]["2"]["32"]["5120"]["8"]["split_k"] == 4
    text = lora_tune.render(tune_report(), tmp_path)
    assert "| 32 | " in text and "tuned / default" in text


@pytest.mark.skipif(APHRODITE_VERSION != "0.24.1", reason="the tuned-config lookup read here is 0.24's")
def test_aphrodites_own_lookup_finds_the_tuned_configs(tmp_path, monkeypatch):
    import torch
    from aphrodite.lora.ops.triton_ops import utils

    lora_tune.write_configs(tune_report(), tmp_path)
    monkeypatch.setattr(utils.envs, "APHRODITE_TUNED_CONFIG_FOLDER", str(tmp_path), raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")  # a fake input: the GPU's name
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    try:
        for slices in (1, 2, 3, 4):
            for m in (1, 5, 33, 300, 2048):
                cfg = utils.get_lora_op_configs("shrink", 2, m, 5120, 8, slices)
                assert cfg["block_m"] in (16, 32) and "split_k" in cfg
                cfg = utils.get_lora_op_configs("expand", 2, m, 17408, 8, slices, add_inputs=True)
                assert "block_n" in cfg
    finally:
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()
