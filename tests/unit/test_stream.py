"""The full-depth writer: sharded layer by layer, EXL3 lm_head at its own bitrate, the
folder as doctor and aphrodite read it; the published shapes' presets."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from helpers import needs_aphrodite
from hybrid_exl3_fixes.checkpoint.stream import FULL_PRESETS, full_spec, write_full
from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, _check

EIGHT = (("linear_attention",) * 3 + ("full_attention",)) * 2


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    dest = tmp_path_factory.mktemp("full") / "f"
    spec = TinySpec(layer_types=EIGHT, bits=3, head_bits=6, adapters=("lora-a",))
    return dest, spec, write_full(dest, spec, device="cpu")


def test_one_shard_per_layer_and_an_index(full):
    dest, spec, manifest = full
    folder = dest / "exl3"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    # globals, one shard per decoder layer, the head, the MTP head
    assert len(shards) == len(spec.layer_types) + 3 and set(index["weight_map"].values()) == set(shards)
    for n in range(len(spec.layer_types)):  # every tensor of layer n in shard n + 1, nothing else there
        with safe_open(str(folder / shards[n + 1]), "pt") as f:
            assert {k.split(".")[3] for k in f.keys()} == {str(n)}
    with safe_open(str(folder / shards[-1]), "pt") as f:
        assert {k.split(".")[0] for k in f.keys()} == {"mtp"} and "mtp.fc.trellis" in f.keys()
    assert manifest["mtp_modules"] and not set(manifest["mtp_modules"]) & set(manifest["exl3_modules"])
    assert index["metadata"]["total_size"] == manifest["weight_bytes"]


def test_two_adapters_one_without_the_mlp_one_with_it(full):
    dest, _, manifest = full
    a, mlp = (set(manifest["adapters"][k]) for k in ("lora-a", "lora-mlp"))
    assert a < mlp and all(".mlp." not in k for k in a)
    assert {k.split(".")[-3] for k in mlp - a} == {"gate_proj", "up_proj", "down_proj"}
    for name in ("lora-a", "lora-mlp"):
        config = json.loads((dest / name / "adapter_config.json").read_text())
        assert ("down_proj" in config["target_modules"]) == (name == "lora-mlp")


def test_a_moe_full_writer_adapts_the_shared_expert_not_the_routed_ones(tmp_path):
    spec = TinySpec(layer_types=EIGHT[:4], experts=4, experts_per_tok=2, moe_intermediate=256, shared_intermediate=256)
    manifest = write_full(tmp_path / "m", spec, device="cpu")
    mlp = [k for k in manifest["adapters"]["lora-mlp"] if ".mlp." in k]
    assert mlp and all(".mlp.shared_expert." in k for k in mlp)
    assert not [k for k in manifest["adapters"]["lora-a"] if ".mlp." in k]
    # P13's adapter: lora-mlp's keys and each layer's routed experts in PEFT's target_parameters form
    experts = set(manifest["adapters"]["lora-experts-3d"]) - set(manifest["adapters"]["lora-mlp"])
    assert len(experts) == 4 * 4 and all(k.split(".mlp.")[1].startswith("experts.") for k in experts)
    config = json.loads((tmp_path / "m" / "lora-experts-3d" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_exl3_head_and_configs(full):
    dest, spec, _ = full
    cfg = json.loads((dest / "exl3" / "config.json").read_text())
    assert cfg["quantization_config"]["head_bits"] == 6 and cfg["quantization_config"]["bits"] == 3.0
    storage = json.loads((dest / "exl3" / "quantization_config.json").read_text())["tensor_storage"]
    assert storage["lm_head"]["quant_format"] == "exl3" and storage["lm_head"]["bits_per_weight"] == 6
    assert storage["model.language_model.layers.7.self_attn.o_proj"]["bits_per_weight"] == 3
    head_shard = sorted((dest / "exl3").glob("*.safetensors"))[len(spec.layer_types) + 1]
    with safe_open(str(head_shard), "pt") as f:
        assert f.get_slice("lm_head.trellis").get_shape() == [256 // 16, 512 // 16, 96]


def test_doctor_reads_it_clean(full):
    from hybrid_exl3_fixes.doctor import diagnose

    dest, _, _ = full
    report = diagnose(dest / "exl3", tp=2, language_model_only=True, check_overlay=False)
    assert report.exit_code == 0, [(f.level, f.message) for f in report.findings if f.level != "OK"]
    assert {f.check: f.level for f in report.findings}["head_bits"] == "OK"


@needs_aphrodite
def test_aphrodite_sees_an_exl3_head(full):
    from aphrodite.model_executor.layers.quantization.exl3 import Exl3Config

    dest, _, _ = full
    q = json.loads((dest / "exl3" / "quantization_config.json").read_text())
    config = Exl3Config(bits=3.0, head_bits=6, tensor_storage=q["tensor_storage"])
    assert config.has_quantized_lm_head() and config._linear_prefix_is_exl3("lm_head")


@pytest.mark.parametrize("name", sorted(FULL_PRESETS))
def test_published_shapes_split_at_tp2(name):
    spec = full_spec(name, tp=2)
    _check(spec)
    assert spec.vocab % 128 == 0 and len(spec.layer_types) % 4 == 0 and spec.head_bits == 6


def test_full_preset_without_cuda_is_a_one_line_error(tmp_path, capsys):
    import torch

    from hybrid_exl3_fixes.cli import main

    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    assert main(["make-tiny", str(tmp_path / "x"), "--preset", "qwen3.6-27b-full"]) == 2
    assert "no CUDA device" in capsys.readouterr().err and list(tmp_path.iterdir()) == []
