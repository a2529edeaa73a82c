"""doctor: checks, memory plan formulas, exit codes (CPU, files only)."""

from __future__ import annotations

import json
import shutil

import pytest

from hybrid_exl3_fixes.doctor import diagnose
from hybrid_exl3_fixes.exl3.tiny import TinySpec, write_tiny

QWEN36_27B_TEXT = {  # the second deployment's model, as the issue gives it
    "num_hidden_layers": 64, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 5120,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    dest = tmp_path_factory.mktemp("d") / "tiny"
    write_tiny(dest, TinySpec(bits=4, codebook="mcg"))
    return dest / "exl3"


def levels(report):
    return {f.check: f.level for f in report.findings}


def test_27b_hybrid_economics(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                      "text_config": QWEN36_27B_TEXT}))
    plan = diagnose(tmp_path, check_overlay=False).plan
    assert plan["kv_bytes_per_token"] == 64 * 1024  # 16 full layers x 4 x 256 x 2 x 2 B
    assert plan["recurrent_state_bytes_per_sequence"] == 144 * 1024 * 1024  # 48 layers x 3 MiB
    assert plan["state_bytes_per_sequence"] < 150 * 1024 * 1024  # + the small conv state
    assert plan["image_tokens_per_image"] == 16384
    fp8 = diagnose(tmp_path, kv_dtype="fp8", check_overlay=False).plan
    assert fp8["kv_bytes_per_token"] == 32 * 1024


def test_27b_on_four_24g_cards(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                      "text_config": QWEN36_27B_TEXT}))
    report = diagnose(tmp_path, gpu_mem=24, gpus=4, tp=4, max_model_len=131072, check_overlay=False)
    p = report.plan
    assert p["image_reservation_bytes"] == 16384 * 64 * 1024  # 1 GiB of KV for one default image
    assert p["bytes_per_sequence_at_context"] == 131072 * 65536 + p["state_bytes_per_sequence"]
    assert p["max_concurrency_at_context"] == int(p["kv_pool_bytes"] // p["bytes_per_sequence_at_context"])
    assert levels(report)["processor"] == "BLOCK"  # no processor files in this folder
    assert report.exit_code == 2


def test_tiny_checkpoint_is_clean_text_only(tiny):
    report = diagnose(tiny, gpu_mem=12, tp=2, max_model_len=512, language_model_only=True, check_overlay=False)
    assert report.exit_code == 0, [f.__dict__ for f in report.findings]
    assert levels(report)["exl3"] == "OK"
    assert report.plan["exl3_weight_bytes"] > 0


def test_missing_processor_files_are_named(tiny):
    report = diagnose(tiny, check_overlay=False)
    msg = next(f.message for f in report.findings if f.check == "processor")
    assert "preprocessor_config.json" in msg and "video_preprocessor_config.json" in msg and report.exit_code == 2


def test_tp_that_cuts_a_hadamard_block(tiny):
    report = diagnose(tiny, tp=4, language_model_only=True, check_overlay=False)
    assert levels(report)["tp-alignment"] == "BLOCK"
    assert "in_proj_qkv: 256 / TP 4 = 64" in next(f.message for f in report.findings if f.check == "tp-alignment")


def test_tensor_storage_mismatch_and_head_bits_trap(tiny, tmp_path):
    broken = tmp_path / "m"
    shutil.copytree(tiny, broken)
    q = json.loads((broken / "quantization_config.json").read_text())
    first = next(iter(q["tensor_storage"].values()))
    first["stored_tensors"]["model.ghost.trellis"] = {"shape": [1, 1, 64]}
    (broken / "quantization_config.json").write_text(json.dumps(q))
    cfg = json.loads((broken / "config.json").read_text())
    cfg["quantization_config"]["head_bits"] = 6
    (broken / "config.json").write_text(json.dumps(cfg))
    report = diagnose(broken, language_model_only=True, check_overlay=False)
    assert levels(report)["exl3"] == "BLOCK" and "model.ghost.trellis" in next(f.message for f in report.findings if f.check == "exl3")
    assert levels(report)["head_bits"] == "BLOCK"


def test_no_config_and_bad_config(tmp_path):
    assert diagnose(tmp_path, check_overlay=False).exit_code == 2
    (tmp_path / "config.json").write_text("{not json")
    report = diagnose(tmp_path, check_overlay=False)
    assert report.exit_code == 2 and "does not parse" in report.findings[0].message


def test_cli_json(tiny, capsys):
    from hybrid_exl3_fixes.cli import main

    code = main(["doctor", str(tiny), "--language-model-only", "--json", "--gpu-mem", "12"])
    out = json.loads(capsys.readouterr().out)
    assert code == out["exit_code"] and out["plan"]["kv_bytes_per_token"] == 2048


@pytest.mark.parametrize("version, enable_lora, expected", [
    ("0.21.0", False, "WARN"),  # measured: the compiled engine crashes without LoRA
    ("0.21.0", True, "OK"),     # measured: with LoRA (separate GDN projections) it compiles
    ("0.20.0", False, "WARN"),  # the same construction
    ("0.24.1", False, None),    # not measured: no claim
    (None, False, None),        # aphrodite not installed
])
def test_compiled_mode_warning_names_the_workaround(tiny, version, enable_lora, expected):
    from hybrid_exl3_fixes.doctor import Report, check_compiled_mode

    config = json.loads((tiny / "config.json").read_text())
    report = Report(str(tiny))
    check_compiled_mode(report, config, enable_lora, version)
    assert levels(report).get("compiled-mode") == expected
    if expected == "WARN":
        msg = report.findings[0].message
        assert '"cudagraph_mode": "FULL_DECODE_ONLY"' in msg and "--enforce-eager" in msg and version in msg
    dense = {**config, "quantization_config": None}
    quiet = Report(str(tiny))
    check_compiled_mode(quiet, dense, enable_lora, version)
    assert quiet.findings == []  # the dense twin compiles
