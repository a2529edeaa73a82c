"""P5 (EXL3 MoE + LoRA) against the real aphrodite-engine modules of the lane's release (CPU).

Every release 0.20.0 - 0.24.1 wraps an EXL3 MoE layer in FusedMoEWithLoRA, whose constructor then
fails for want of a modular kernel; the overlay declines those layers and refuses adapters that
carry routed-expert weights, naming them. The GPU half (tests/gpu/test_moe_server.py) serves it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import needs_aphrodite

pytestmark = needs_aphrodite


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

    dest = tmp_path_factory.mktemp("p5") / "m"
    write_tiny(dest, TinySpec.preset("tiny-moe"), dense=False)
    return dest


def plain_moe_layer():
    """An instance of the live MoE layer class without EXL3 tensors (a bfloat16 MoE as LoRA sees it)."""
    from hybrid_exl3_fixes.aphrodite.lora.layers.fused_moe import moe_layer_class

    layer = object.__new__(moe_layer_class())
    torch.nn.Module.__init__(layer)
    return layer


def test_unpatched_lora_code_wraps_exl3_moe_layers_that_have_no_lora_kernel(overlay):
    """The bug on this release: FusedMoEWithLoRA takes the EXL3 MoE layer, and Exl3MoEMethod gives it
    no kernel (its constructor then raises select_gemm_impl's ValueError on 0.20/0.21, "Old-style
    modular kernel not supported" on 0.22+)."""
    from aphrodite.lora.layers import fused_moe

    from hybrid_exl3_fixes.aphrodite.lora.layers.fused_moe import (
        PATCH,
        exl3_moe_method_has_no_lora_kernel,
        stand_in_exl3_moe_layer,
    )

    layer = stand_in_exl3_moe_layer()
    assert fused_moe.FusedMoEWithLoRA.can_replace_layer(layer, None, ["w1", "w3"])
    assert exl3_moe_method_has_no_lora_kernel()
    assert PATCH.probe({t.key: overlay.REGISTRY._resolve(t) for t in PATCH.targets})


def test_upstream_constructor_error_on_this_release():
    """The error the wrapper's constructor reaches for Exl3MoEMethod, read from the installed code."""
    import inspect

    from aphrodite.lora.layers import fused_moe
    from aphrodite.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from aphrodite.model_executor.layers.quantization.exl3 import Exl3MoEMethod

    if hasattr(FusedMoEMethodBase, "select_gemm_impl"):  # 0.20/0.21: the base class answers with the error
        method = object.__new__(Exl3MoEMethod)
        with pytest.raises(ValueError, match="new modular kernel initialization logic"):
            method.select_gemm_impl(None, None)
    else:  # 0.22+: the wrapper refuses any method without a modular kernel
        assert "Old-style modular kernel not supported" in inspect.getsource(fused_moe.FusedMoEWithLoRA.__init__)


def test_p5_declines_exl3_moe_layers_only(overlay):
    from aphrodite.lora.layers import fused_moe

    from hybrid_exl3_fixes.aphrodite.lora.layers.fused_moe import PATCH, stand_in_exl3_moe_layer

    plain_before = fused_moe.FusedMoEWithLoRA.can_replace_layer(plain_moe_layer(), None, ["w1", "w3"])
    assert overlay.REGISTRY.apply(PATCH).status.value == "APPLIED"
    for cls, packed in ((fused_moe.FusedMoEWithLoRA, ["w1", "w3"]), (fused_moe.FusedMoE3DWithLoRA, ["w13"])):
        assert cls.can_replace_layer(stand_in_exl3_moe_layer(), None, packed) is False
    # a MoE layer that is not EXL3 is answered by the original, as before
    assert fused_moe.FusedMoEWithLoRA.can_replace_layer(plain_moe_layer(), None, ["w1", "w3"]) == plain_before is True
    assert not PATCH.probe({t.key: overlay.REGISTRY._resolve(t) for t in PATCH.targets})
    assert isinstance(vars(fused_moe.FusedMoEWithLoRA)["can_replace_layer"], classmethod)


def lora_manager(model):
    """The worker's LoRA manager around ``model``, built without its constructor (which needs the engine's
    config): _load_adapter reads ``_adapter_manager.model`` before anything else."""
    from aphrodite.lora.worker_manager import WorkerLoRAManager

    manager = object.__new__(WorkerLoRAManager)
    manager._adapter_manager = SimpleNamespace(model=model)
    return manager


def exl3_moe_model():
    from hybrid_exl3_fixes.aphrodite.lora.layers.fused_moe import stand_in_exl3_moe_layer

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
    for block in model.layers:
        block.mlp = torch.nn.Module()
        block.mlp.experts = stand_in_exl3_moe_layer()
    return model


def request(name, path):
    from aphrodite.lora.request import LoRARequest

    return LoRARequest(name, 1, str(path))


def test_p5_refuses_an_expert_adapter_by_name_before_loading_it(overlay, moe_ckpt):
    from hybrid_exl3_fixes.aphrodite.lora.layers.fused_moe import PATCH

    assert overlay.REGISTRY.apply(PATCH).status.value == "APPLIED"
    manager = lora_manager(exl3_moe_model())
    with pytest.raises(ValueError) as err:
        manager._load_adapter(request("lora-experts", moe_ckpt / "lora-experts"))
    message = str(err.value)
    assert "'lora-experts'" in message and "targets the routed experts of EXL3 MoE layers (2 in this model)" in message
    assert "model.language_model.layers.0.mlp.experts.0.down_proj" in message and "(48 modules)" in message
    assert "shared_expert" not in message and "nothing was loaded" in message


def test_p5_passes_other_adapters_and_other_models_to_aphrodites_loader(overlay, moe_ckpt):
    """lora-a (attention, GDN, shared expert) on the EXL3 MoE model, and lora-experts on a model without
    EXL3 MoE layers, reach aphrodite's own loader: the manager built here lacks what it reads next
    (AttributeError), which is not P5's refusal."""
    from hybrid_exl3_fixes.aphrodite.lora.layers.fused_moe import PATCH

    assert overlay.REGISTRY.apply(PATCH).status.value == "APPLIED"
    for model, adapter in ((exl3_moe_model(), "lora-a"), (torch.nn.Module(), "lora-experts")):
        with pytest.raises(AttributeError, match="supported_lora_modules"):
            lora_manager(model)._load_adapter(request(adapter, moe_ckpt / adapter))


def test_adapter_file_modules_reads_peft_names(moe_ckpt):
    from hybrid_exl3_fixes.aphrodite.lora.layers.fused_moe import adapter_file_modules, expert_modules

    names = adapter_file_modules(moe_ckpt / "lora-a")
    assert "model.language_model.layers.0.mlp.shared_expert.gate_proj" in names
    assert expert_modules(names) == []
    assert len(expert_modules(adapter_file_modules(moe_ckpt / "lora-experts"))) == 4 * 4 * 3
    assert adapter_file_modules(moe_ckpt / "no-such-folder") == []


def test_an_unreadable_adapter_file_is_left_to_aphrodites_loader(tmp_path):
    from hybrid_exl3_fixes.aphrodite.lora.layers.fused_moe import adapter_file_modules

    (tmp_path / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    assert adapter_file_modules(tmp_path) == []


def wrapped_exl3_moe_model():
    """The model as the LoRA manager leaves it when P13 gave every EXL3 MoE layer a LoRA kernel: each layer is its
    wrapper's ``base_layer``."""
    from hybrid_exl3_fixes.aphrodite.lora.layers.fused_moe import stand_in_exl3_moe_layer

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
    for block in model.layers:
        block.mlp = torch.nn.Module()
        block.mlp.experts = torch.nn.Module()
        block.mlp.experts.base_layer = stand_in_exl3_moe_layer()
    return model


@pytest.mark.parametrize("mixed", [False, True])
def test_with_the_layers_wrapped_the_fused_form_passes_and_the_per_expert_one_needs_the_flag(overlay, moe_ckpt, mixed):
    """Once P13's kernels let the wrapper take every EXL3 MoE layer, expert adapters are no longer refused as such;
    on a model whose MoE LoRA wrappers take the fused form (Qwen3.5/3.6: is_3d_moe_weight), an adapter in the
    per-expert form is refused naming the form and the flag that takes it, unless that flag is on."""
    from hybrid_exl3_fixes.aphrodite.lora.layers.fused_moe import PATCH

    assert overlay.REGISTRY.apply(PATCH).status.value == "APPLIED"

    def manager():
        m = lora_manager(wrapped_exl3_moe_model())
        m._adapter_manager._is_3d_moe_model = True
        m._adapter_manager.lora_config = SimpleNamespace(enable_mixed_moe_lora_format=mixed)
        return m

    with pytest.raises(AttributeError, match="supported_lora_modules"):  # aphrodite's own loader, past P5
        manager()._load_adapter(request("lora-experts-3d", moe_ckpt / "lora-experts-3d"))
    if mixed:
        with pytest.raises(AttributeError, match="supported_lora_modules"):
            manager()._load_adapter(request("lora-experts", moe_ckpt / "lora-experts"))
        return
    with pytest.raises(ValueError) as err:
        manager()._load_adapter(request("lora-experts", moe_ckpt / "lora-experts"))
    message = str(err.value)
    assert "per-expert form" in message and "--enable-mixed-moe-lora-format" in message
    assert "mlp.experts.0.down_proj" in message and "nothing was loaded" in message


def test_an_unwrapped_model_refuses_the_fused_form_too(overlay, moe_ckpt):
    from hybrid_exl3_fixes.aphrodite.lora.layers.fused_moe import PATCH

    assert overlay.REGISTRY.apply(PATCH).status.value == "APPLIED"
    with pytest.raises(ValueError, match="targets the routed experts of EXL3 MoE layers") as err:
        lora_manager(exl3_moe_model())._load_adapter(request("lora-experts-3d", moe_ckpt / "lora-experts-3d"))
    assert "model.language_model.layers.0.mlp.experts.base_layer" in str(err.value)
