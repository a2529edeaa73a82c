"""The tiny MoE hybrid (make-tiny --preset tiny-moe): a Qwen3_5MoeForConditionalGeneration
with routed experts and a shared expert, experts in EXL3 mcg. Its names and tensor_storage against
exllamav3's sources (read with ast), its dense twin against transformers, its EXL3 experts against
aphrodite's own Exl3Config, and doctor's MoE checks."""

from __future__ import annotations

import ast
import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import HAS_APHRODITE, ROOT, needs_aphrodite
from hybrid_exl3_fixes.checkpoint import codec
from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

SOURCES = sorted((ROOT / ".cache" / "exllamav3").glob("*/exllamav3"))
EXL = SOURCES[-1] if SOURCES else None
needs_exllamav3 = pytest.mark.skipif(not SOURCES, reason="exllamav3 sources not fetched (bash ci/exllamav3-source.sh)")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    dest = tmp_path_factory.mktemp("moe") / "m"
    manifest = write_tiny(dest, TinySpec.preset("tiny-moe"))
    return dest, manifest


def test_config_and_exl3_layout(moe):
    dest, manifest = moe
    cfg = json.loads((dest / "exl3" / "config.json").read_text())
    text = cfg["text_config"]
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and cfg["model_type"] == "qwen3_5_moe"
    assert text["model_type"] == "qwen3_5_moe_text" and "intermediate_size" not in text
    assert (
        text["num_experts"],
        text["num_experts_per_tok"],
        text["moe_intermediate_size"],
        text["shared_expert_intermediate_size"],
    ) == (4, 2, 256, 256)
    storage = json.loads((dest / "exl3" / "quantization_config.json").read_text())["tensor_storage"]
    layer0 = {k.split("layers.0.", 1)[1]: v for k, v in storage.items() if ".layers.0." in k}
    experts = [f"mlp.experts.{e}.{w}" for e in range(4) for w in ("gate_proj", "up_proj", "down_proj")]
    shared = [f"mlp.shared_expert.{w}" for w in ("gate_proj", "up_proj", "down_proj")]
    for name in experts + shared:
        assert layer0[name]["quant_format"] == "exl3", name
    assert all(manifest["codebooks"][f"model.language_model.layers.0.{e}"] == "mcg" for e in experts)
    for name in ("mlp.gate", "mlp.shared_expert_gate"):  # router and shared gate stay plain linears
        assert "quant_format" not in layer0[name]
    tensors = load_file(str(dest / "exl3" / "model.safetensors"))
    assert tensors["model.language_model.layers.0.mlp.gate.weight"].shape == (4, 256)
    assert tensors["model.language_model.layers.0.mlp.gate.weight"].dtype == torch.float16
    assert tensors["model.language_model.layers.0.mlp.experts.3.down_proj.trellis"].shape == (16, 16, 64)
    assert len(manifest["exl3_modules"]) == 3 * 3 + 4 + 4 * (4 * 3 + 3)


def test_dense_twin_loads_in_transformers_with_fused_experts(moe):
    from transformers import Qwen3_5MoeForConditionalGeneration

    dest, _ = moe
    model, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(dest / "dense", output_loading_info=True)
    assert not any(info.values()), info
    exl3 = load_file(str(dest / "exl3" / "model.safetensors"))
    dense = load_file(str(dest / "dense" / "model.safetensors"))
    p = "model.language_model.layers.1.mlp.experts"

    def decoded(e, w):
        parts = {k.rsplit(".", 1)[1]: v for k, v in exl3.items() if k.startswith(f"{p}.{e}.{w}.")}
        return codec.dense_weight(parts, 4).t()

    assert torch.equal(dense[f"{p}.gate_up_proj"][2], torch.cat([decoded(2, "gate_proj"), decoded(2, "up_proj")]))
    assert torch.equal(dense[f"{p}.down_proj"][3], decoded(3, "down_proj"))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()


def test_adapters_leave_the_experts_out_except_lora_experts(moe):
    dest, _ = moe
    for name in ("lora-a", "lora-b", "lora-experts"):
        keys = load_file(str(dest / name / "adapter_model.safetensors")).keys()
        has_experts = any(".mlp.experts." in k for k in keys)
        assert has_experts == (name == "lora-experts"), name
        assert any(".mlp.shared_expert.gate_proj.lora_A" in k for k in keys)
        assert any(".linear_attn.in_proj_qkv.lora_B" in k for k in keys)


@needs_exllamav3
def test_expert_names_and_unquantized_gates_match_exllamav3(moe):
    """exllamav3's qwen3_5.py builds the MoE MLP as BlockSparseMLP(key_up="experts.{expert_idx}.up_proj",
    key_routing_gate="gate", key_shared_gate="shared_expert_gate", shared_experts=GatedMLP(key=...
    ".mlp.shared_expert")), and block_sparse_mlp.py builds the routing and shared gates with qmap=None."""
    tree = ast.parse((EXL / "architecture" / "qwen3_5.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "BlockSparseMLP")
    kwargs = {k.arg: k.value for k in call.keywords}
    strings = {k: v.value for k, v in kwargs.items() if isinstance(v, ast.Constant)}
    assert strings["key_gate"] == "experts.{expert_idx}.gate_proj"
    assert strings["key_down"] == "experts.{expert_idx}.down_proj"
    assert strings["key_routing_gate"] == "gate" and strings["key_shared_gate"] == "shared_expert_gate"
    shared = kwargs["shared_experts"]
    assert ast.unparse(next(k.value for k in shared.keywords if k.arg == "key")).endswith(".mlp.shared_expert'")
    block = ast.parse((EXL / "modules" / "block_sparse_mlp.py").read_text())

    def is_gate(call):
        key = next((ast.unparse(k.value) for k in call.keywords if k.arg == "key"), "")
        return "key_routing_gate" in key or "key_shared_gate" in key

    linears = [n for n in ast.walk(block) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Linear"]
    gates = [g for g in linears if is_gate(g)]
    assert len(gates) == 2
    assert all(any(k.arg == "qmap" and ast.unparse(k.value) == "None" for k in g.keywords) for g in gates)
    dest, _ = moe
    storage = json.loads((dest / "exl3" / "quantization_config.json").read_text())["tensor_storage"]
    for e in range(4):
        name = strings["key_up"].format(expert_idx=e)
        assert storage[f"model.language_model.layers.2.mlp.{name}"]["quant_format"] == "exl3"


@needs_exllamav3
def test_exllamav3_reads_the_moe_checkpoint(moe):
    from test_exllamav3_layout import read_with_exllamav3

    dest, _ = moe
    read = read_with_exllamav3(dest / "exl3")
    assert read == {
        "config": "Qwen3_5VLMoeConfig",
        "model": "Qwen3_5VLMoeModel",
        "hidden": 256,
        "layers": 4,
        "vision": True,
    }


@needs_aphrodite
def test_aphrodite_sees_exl3_experts(moe):
    """aphrodite's own Exl3Config, given the checkpoint's tensor_storage, treats every layer's experts as
    an EXL3 MoE (Exl3MoEMethod) and the shared expert's fused gate/up as an EXL3 linear."""
    from aphrodite.model_executor.layers.quantization.exl3 import Exl3Config

    dest, _ = moe
    q = json.loads((dest / "exl3" / "quantization_config.json").read_text())
    config = Exl3Config(bits=4.0, head_bits=None, tensor_storage=q["tensor_storage"])
    assert config.has_moe_tensors()
    for n in range(4):
        assert config._moe_prefix_is_exl3(f"language_model.model.layers.{n}.mlp.experts")
        assert config._linear_prefix_is_exl3(f"language_model.model.layers.{n}.mlp.shared_expert.gate_up_proj")
        assert not config._linear_prefix_is_exl3(f"language_model.model.layers.{n}.mlp.gate")


@pytest.mark.parametrize(
    "version, codebook, expected",
    [
        ("0.21.0", "mcg", "OK"),
        ("0.21.0", "mul1", "BLOCK"),
        ("0.21.0", "3inst", "BLOCK"),
        ("0.24.1", "mul1", "OK"),
        ("0.24.1", "3inst", "BLOCK"),
        (None, "mul1", "WARN"),
        (None, "mcg", "OK"),
    ],
)
def test_doctor_checks_expert_codebooks_against_the_installed_kernel(
    tmp_path, monkeypatch, version, codebook, expected
):
    """doctor reads the EXL3 MoE kernel's codebook rule from the installed kernel library (0.20-0.23:
    mcg only; 0.24: mcg and mul1); without a library it warns about anything but mcg."""
    from hybrid_exl3_fixes import doctor
    from hybrid_exl3_fixes.decisions import exl3_kernels as kernels

    libs = sorted((ROOT / ".cache" / "aphrodite-kernels" / version / "aphrodite").glob("*.so")) if version else []
    if version and not libs:
        pytest.skip(f"aphrodite {version} kernel libraries not unpacked (ci/aphrodite-versions.sh)")
    monkeypatch.setattr(kernels, "installed_kernel_libraries", lambda: libs)  # which library, not how it is read
    write_tiny(tmp_path / "m", TinySpec.preset("tiny-moe", expert_codebook=codebook), dense=False)
    report = doctor.diagnose(tmp_path / "m" / "exl3", language_model_only=True, check_overlay=False)
    found = {f.check: f for f in report.findings}["moe-codebook"]
    assert found.level == expected, found.message
    if expected != "OK":
        assert "quantize the experts with exllamav3's --codebook mcg" in found.message
    assert report.plan["expert_weight_bytes"] > 0
    assert report.plan["active_expert_bytes_per_token"] == report.plan["expert_weight_bytes"] // 2  # 2 of 4


def finding(check, dest, folder, *args):
    """Run one doctor check on the shape of ``dest/folder``'s config; its finding (None: it said nothing)."""
    from hybrid_exl3_fixes import doctor

    report = doctor.Report(str(dest))
    shape = doctor.parse_config(json.loads((dest / folder / "config.json").read_text()))[0]
    getattr(doctor, check)(report, shape, *args)
    return report.findings[0] if report.findings else None


@pytest.mark.parametrize(
    "p5, expected",
    [("APPLIED", "OK"), ("UPSTREAM_FIXED", "OK"), ("DISABLED", "BLOCK"), (None, "WARN"), ("NOT_APPLICABLE", "WARN")],
)
def test_doctor_on_exl3_moe_with_lora_follows_p5(moe, p5, expected):
    """EXL3 MoE + --enable-lora stops at start-up on every release unless P5 runs (run 11, 0.21.0)."""
    dest, _ = moe
    found = finding("check_moe_lora", dest, "exl3", True, p5)
    assert found.check == "moe-lora" and found.level == expected, found.message
    if expected != "OK":
        assert "new modular kernel initialization logic" in found.message
    assert finding("check_moe_lora", dest, "exl3", False, p5) is None  # without --enable-lora nothing to say


@pytest.mark.parametrize(
    "p7, eager, expected",
    [
        ("APPLIED", False, "OK"),
        ("UPSTREAM_FIXED", False, "OK"),
        ("DISABLED", False, "WARN"),
        (None, False, "WARN"),
        ("DISABLED", True, "OK"),
    ],
)
def test_doctor_on_exl3_moe_in_cuda_graphs_follows_p7(moe, p7, eager, expected):
    """EXL3 MoE in the default compiled mode drops experts over the fused kernel's capacity on every release
    unless P7 runs (run 13, 0.21.0); eager mode has no graphs. Only the missing fix costs --enforce-eager."""
    dest, _ = moe
    found = finding("check_moe_graphs", dest, "exl3", eager, p7)
    assert found.check == "moe-graphs" and found.level == expected, found.message
    assert ("--enforce-eager (no CUDA graphs: slower)" in found.message) == (expected == "WARN")
    assert finding("check_moe_graphs", dest, "dense", False, None) is None  # the twin is not EXL3: nothing to say


@pytest.mark.parametrize(
    "p6, expected",
    [("APPLIED", "OK"), ("UPSTREAM_FIXED", "OK"), ("DISABLED", "WARN"), (None, "WARN"), ("NOT_APPLICABLE", "WARN")],
)
def test_doctor_on_an_exl3_moe_shared_expert_follows_p6(moe, p6, expected):
    """Without P6 the shared expert's EXL3 kernels share the GPU with the routed experts' on a second stream, and an
    eager server stopped answering (run 14, 0.21.0); the workaround without the overlay is named."""
    dest, _ = moe
    found = finding("check_moe_stream", dest, "exl3", p6)
    assert found.check == "moe-stream" and found.level == expected, found.message
    assert ("APHRODITE_DISABLE_SHARED_EXPERTS_STREAM=1" in found.message) == (expected == "WARN")
    assert finding("check_moe_stream", dest, "dense", None) is None  # the twin is not EXL3: nothing to say


@pytest.mark.parametrize(
    "p9, expected",
    [
        ("APPLIED", "OK"),
        ("UPSTREAM_FIXED", "OK"),
        ("DISABLED", "BLOCK"),
        ("DRIFTED", "BLOCK"),
        (None, "WARN"),
        ("NOT_APPLICABLE", "OK" if HAS_APHRODITE else "WARN"),  # with aphrodite here: a release before 0.23.0
    ],
)
def test_doctor_on_exl3_moe_padding_ids_follows_p9(moe, monkeypatch, p9, expected):
    """0.23+ give padding rows expert id -1 and every EXL3 MoE model stopped at start-up without P9 (run 15, 0.24.1);
    the workaround without the overlay is named, and set it makes the check OK."""
    monkeypatch.delenv("APHRODITE_MOE_SKIP_PADDING", raising=False)
    dest, _ = moe
    found = finding("check_moe_padding", dest, "exl3", p9)
    assert found.check == "moe-padding" and found.level == expected, found.message
    assert ("APHRODITE_MOE_SKIP_PADDING=0" in found.message) == (expected != "OK")
    assert finding("check_moe_padding", dest, "dense", None) is None  # the twin is not EXL3: nothing to say
    monkeypatch.setenv("APHRODITE_MOE_SKIP_PADDING", "0")
    assert finding("check_moe_padding", dest, "exl3", p9).level == "OK"


def test_doctor_runs_the_moe_lora_check_with_the_live_overlay(moe):
    from hybrid_exl3_fixes import doctor

    dest, _ = moe
    report = doctor.diagnose(dest / "exl3", language_model_only=True, enable_lora=True)
    level = {f.check: f.level for f in report.findings}["moe-lora"]
    assert level == ("OK" if HAS_APHRODITE else "WARN")
    assert {f.check: f.level for f in report.findings}["moe-graphs"] == ("OK" if HAS_APHRODITE else "WARN")
    assert {f.check: f.level for f in report.findings}["moe-stream"] == ("OK" if HAS_APHRODITE else "WARN")
    assert {f.check: f.level for f in report.findings}["moe-padding"] == ("OK" if HAS_APHRODITE else "WARN")


def test_the_fused_expert_adapter_is_peft_s_target_parameters_form(moe):
    """lora-experts-3d: PEFT loads it on the dense twin's fused experts (a ParamWrapper on gate_up_proj, nested in
    one on down_proj), and PEFT's own per-expert delta is what aphrodite's manager makes of the saved factors
    (lora/model_manager.py _stack_moe_lora_weights: A.reshape(E, r, in), B.reshape(out, r, E) -> (E, out, r))."""
    peft = pytest.importorskip("peft", reason="peft is the reference the GPU suite compares against")
    from transformers import AutoModelForImageTextToText

    dest, _ = moe
    spec = TinySpec.preset("tiny-moe")
    base = AutoModelForImageTextToText.from_pretrained(str(dest / "dense"), dtype=torch.float32)
    experts = base.model.language_model.layers[0].mlp.experts
    shapes = {p: getattr(experts, p).shape for p in ("gate_up_proj", "down_proj")}  # before PEFT wraps them
    model = peft.PeftModel.from_pretrained(base, str(dest / "lora-experts-3d"))
    wrappers = {n: m for n, m in model.named_modules() if n.endswith(("mlp.experts", "mlp.experts.base_layer"))}
    assert len(wrappers) == 2 * len(spec.layer_types) and all(hasattr(m, "lora_A") for m in wrappers.values())
    saved = load_file(str(dest / "lora-experts-3d" / "adapter_model.safetensors"))
    e, r, scale = spec.experts, spec.lora_rank, 2.0
    for sub, param in ((".base_layer", "gate_up_proj"), ("", "down_proj")):
        key = f"base_model.model.model.language_model.layers.0.mlp.experts{sub}"
        a, b = saved[f"{key}.lora_A.weight"].float(), saved[f"{key}.lora_B.weight"].float()
        per_expert = scale * torch.bmm(b.reshape(b.shape[0], -1, e).permute(2, 0, 1), a.reshape(e, -1, a.shape[-1]))
        name = next(n for n in wrappers if n.endswith(f"layers.0.mlp.experts{sub}"))
        peft_delta = wrappers[name].get_delta_weight("default").float()
        assert per_expert.shape == peft_delta.shape == shapes[param] and a.shape[0] == e * r
        assert torch.allclose(per_expert, peft_delta, atol=1e-5)
    keys = [k for k in saved if ".mlp.experts." in k]
    assert keys and not any(k.split(".mlp.experts.")[1][0].isdigit() for k in keys)  # no per-expert keys


@pytest.mark.parametrize("adapter", ["lora-experts-3d"])
def test_the_expert_deltas_move_the_answers_past_the_server_cells_check(moe, adapter):
    """The MoE cells assert that a served expert adapter is far (3 x tolerance) from the reference without its
    expert deltas; on this checkpoint those deltas alone must move the answers that far, or the check proves
    nothing."""
    from test_tiny import SERVER_TOLERANCE, lora_off, served_distance

    dest, _ = moe
    off = served_distance(dest, adapter, 3, lambda m: lora_off(m, ("mlp.experts", "mlp.experts.base_layer")))
    assert off > 3 * SERVER_TOLERANCE, off
