"""bench/roofline.py: the bytes of one decode step, from real header tables (run 11's 9B) and the tiny MoE."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import roofline  # noqa: E402

INPUTS = ROOT / "docs" / "gpu-runs" / "2026-12-01-run11" / "cal" / "inputs-9b-exl3.json"


@pytest.fixture(scope="module")
def nine_b():
    from hybrid_exl3_fixes.doctor import parse_config

    data = json.loads(INPUTS.read_text())
    return parse_config(data["config.json"])[0], data["tensors"]


def test_one_sequence_reads_every_weight_but_the_embedding_table(nine_b):
    shape, tensors = nine_b
    b = roofline.step_bytes(shape, tensors, 1, 640)
    total = sum(t["bytes"] for t in tensors.values())
    embed = tensors["model.language_model.embed_tokens.weight"]["bytes"]
    vision = sum(t["bytes"] for k, t in tensors.items() if ".visual." in k)
    assert b["weights"] == pytest.approx(total - vision - embed + embed / 248320)
    assert b["kv"] == 640 * 8 * 4 * 256 * 2 * 2  # 8 full layers x 4 KV heads x 256 x K,V x 2 B
    assert b["state"] > 2 * 24 * 32 * 128 * 128 * 2  # 24 GDN layers, bfloat16 state, read and written


def test_roofline_speed_falls_per_request_and_rises_in_total(nine_b):
    shape, tensors = nine_b
    rows = roofline.roofline(shape, tensors, 4000, [1, 32, 256], 512, 256)
    assert rows[0]["roofline_tok_s"] < rows[1]["roofline_tok_s"] < rows[2]["roofline_tok_s"]
    assert rows[0]["roofline_tok_s_per_request"] > rows[2]["roofline_tok_s_per_request"]
    assert rows[0]["context"] == 640


def test_moe_reads_only_the_routed_experts(tmp_path):
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

    write_tiny(tmp_path / "m", TinySpec.preset("tiny-moe"), dense=False)
    shape, tensors = roofline.load(tmp_path / "m" / "exl3")
    # the MTP head's own experts (mtp.layers.0.mlp.experts.*) are not read by a step without speculative decoding
    experts = sum(t["bytes"] for k, t in tensors.items() if ".mlp.experts." in k and not k.startswith("mtp."))
    embed = sum(t["bytes"] for k, t in tensors.items() if "embed_tokens" in k)
    one, many = roofline.step_bytes(shape, tensors, 1, 64), roofline.step_bytes(shape, tensors, 1000, 64)
    # one token routes to 2 of 4 experts per layer, a thousand to all 4; and reads the whole embedding table
    assert many["weights"] - one["weights"] == pytest.approx(experts / 2 + embed * (1 - 1 / 512), rel=0.001)


def test_bad_arguments_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        roofline.main([str(tmp_path), "--bandwidth", "1000"])
    assert exit_info.value.code == 2 and "has no config.json" in capsys.readouterr().err


RUN25_INPUTS = ROOT / "docs" / "gpu-runs" / "2026-12-05-run25" / "inputs-qwen3.6-27b-full-3bit-exl3.json.xz"


@pytest.fixture(scope="module")
def twenty_seven_b():
    """The 27B at full depth as make-tiny wrote it on the GPU (run 25): its MTP head in EXL3 under ``mtp.``."""
    import lzma

    from hybrid_exl3_fixes.doctor import parse_config

    data = json.loads(lzma.decompress(RUN25_INPUTS.read_bytes()))
    return parse_config(data["config.json"])[0], data["tensors"]


def test_the_mtp_head_is_not_read_by_a_decode_step(twenty_seven_b):
    shape, tensors = twenty_seven_b
    mtp = sum(t["bytes"] for k, t in tensors.items() if k.startswith("mtp."))
    assert mtp > 0.2e9  # 0.213 GB: the 0.24 and 0.21 pages counted it
    b = roofline.step_bytes(shape, tensors, 1, 640)
    without = {k: t for k, t in tensors.items() if not k.startswith("mtp.")}
    assert b["weights"] == pytest.approx(roofline.step_bytes(shape, without, 1, 640)["weights"])
    everything = sum(t["bytes"] for k, t in tensors.items() if ".visual." not in k)
    assert b["weights"] < everything - mtp + 1  # the embedding table aside, nothing of the head counts


def test_each_engine_gets_the_state_bytes_of_its_own_state_dtype(twenty_seven_b):
    shape, tensors = twenty_seven_b
    assert shape.ssm_dtype == "float32"  # the published config's, aphrodite's default
    fp32 = roofline.step_bytes(shape, tensors, 8, 640)
    half = roofline.step_bytes(shape, tensors, 8, 640, state_dtype="float16")  # exllamav3's default
    # 48 GDN layers x 48 value heads x 128 x 128 recurrent, read and written, per sequence; the conv state stays
    recurrent = 2 * 8 * 48 * 48 * 128 * 128
    assert fp32["state"] - half["state"] == recurrent * (4 - 2)
    assert half["weights"] == fp32["weights"] and half["kv"] == fp32["kv"]
    rows = roofline.roofline(shape, tensors, 3000, [1], 512, 256, state_dtype="bfloat16")
    assert rows[0]["state_dtype"] == "bfloat16" and shape.ssm_dtype == "float32"  # the shape is not changed
