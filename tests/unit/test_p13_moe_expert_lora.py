"""P13 without a GPU: the opt-in, the registry entry on every release, the EXL3 LoRA experts built on each release's
own modular-kernel classes and accepted by its ``FusedMoEKernel`` as LoRA-capable, the host-side helpers on fake
inputs, and P5 stepping aside for a layer whose quant method offers such a kernel. The decomposed path's numbers
(EXL3 kernels, MoE-LoRA Triton kernels) need the GPU: against HF + PEFT in the MoE server suite
(docs/drafts/p13-moe-expert-lora.md has the plan)."""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from helpers import APHRODITE_VERSION, fused_moe_config, needs_aphrodite
from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p13_moe_expert_lora as moe_lora
from hybrid_exl3_fixes.registry import tags_of

HAS_MIXIN = APHRODITE_VERSION not in (None, "0.20.0")
EXL3 = "aphrodite.model_executor.layers.quantization.exl3"


@pytest.mark.parametrize("value, on", [("1", True), ("on", True), ("TRUE", True), ("", False), ("0", False)])
def test_the_opt_in(value, on):
    assert moe_lora.enabled({moe_lora.ENABLE_ENV: value}) is on
    assert not moe_lora.enabled({})


@needs_aphrodite
def test_p13_is_an_opt_in(overlay):
    result = {r.patch.id: r for r in overlay.apply_all()}["P13"]
    assert result.status.value == "NOT_APPLICABLE", result.reason
    assert moe_lora.ENABLE_ENV in result.reason, result.reason


@needs_aphrodite
def test_p13_applies_where_the_lora_experts_mixin_is(overlay, monkeypatch):
    monkeypatch.setenv(moe_lora.ENABLE_ENV, "1")
    exl3 = importlib.import_module(EXL3)
    before = vars(exl3.Exl3MoEMethod)["process_weights_after_loading"]
    result = {r.patch.id: r for r in overlay.apply_all()}["P13"]
    if HAS_MIXIN:
        assert result.status.value == "APPLIED", result.reason
        assert "P13" in tags_of(vars(exl3.Exl3MoEMethod)["process_weights_after_loading"])
        overlay.undo_all()
        assert vars(exl3.Exl3MoEMethod)["process_weights_after_loading"] is before
    else:
        assert result.status.value == "NOT_APPLICABLE", result.reason
        assert "LoRAExpertsMixin" in result.reason, result.reason
        assert vars(exl3.Exl3MoEMethod)["process_weights_after_loading"] is before


@pytest.mark.skipif(not HAS_MIXIN, reason="0.20.0 has no LoRAExpertsMixin: P5 keeps refusing expert adapters there")
def test_the_experts_are_a_lora_capable_modular_kernel_on_this_release():
    import aphrodite.model_executor.layers.fused_moe.modular_kernel as mk
    from aphrodite.model_executor.layers.fused_moe.activation import MoEActivation
    from aphrodite.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from aphrodite.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    cls = moe_lora.experts_class()
    assert not cls.__abstractmethods__
    assert issubclass(cls, moe_lora.lora_experts_mixin())
    experts = cls(object(), object(), fused_moe_config(), FUSED_MOE_UNQUANTIZED_CONFIG)
    kernel = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts)
    # what FusedMoEWithLoRA.__init__ asks of the kernel it takes from the quant method
    assert kernel.supports_lora()
    assert type(kernel.impl).__name__ == "FusedMoEKernelModularImpl"
    assert kernel.fused_experts is experts  # 0.24's FusedMoEModularMethod reads its moe_config from there
    if hasattr(kernel, "supports_expert_map"):  # 0.21's FusedMoEModularMethod asks; EXL3 MoE has no expert map
        assert kernel.supports_expert_map() is False
    # the activation (M x topk, I) in workspace13, whose memory the modular kernel also hands out as the output
    # (M, H); cache1 (M x topk, 2I), then the down delta, in workspace2
    assert experts.workspace_shapes(5, 512, 256, 2, 4, 4, None, MoEActivation.SILU) == ((10, 256), (10, 512), (5, 256))
    assert experts.activation_format() == mk.FusedMoEActivationFormat.Standard
    assert cls._supports_activation(MoEActivation.SILU)
    assert not cls._supports_no_act_and_mul()


def test_shape_tensors_carry_the_shapes_without_the_memory():
    layer = types.SimpleNamespace(
        local_num_experts=256,
        exl3_intermediate_size_per_partition=512,
        hidden_size=2048,
        exl3_gate_ptrs_trellis=torch.zeros(256, dtype=torch.long),
    )
    w1, w2 = moe_lora.shape_tensors(layer, torch.bfloat16)
    assert w1.shape == (256, 1024, 2048)
    assert w2.shape == (256, 2048, 512)
    assert (
        w1.untyped_storage().nbytes() == 2
        and w1.dtype == torch.bfloat16
        and w1.device == layer.exl3_gate_ptrs_trellis.device
    )


def test_assignments_are_grouped_by_expert_with_their_flat_positions():
    ids = torch.tensor([[2, 0], [0, 3], [2, 3]])  # three tokens, two experts each
    got = [(e, pos.tolist()) for e, pos in moe_lora.assignments_by_expert(ids)]
    assert [e for e, _ in got] == [0, 2, 3]
    assert {e: sorted(p) for e, p in got} == {0: [1, 2], 2: [0, 4], 3: [3, 5]}  # position t * 2 + j
    for expert, pos in got:
        assert all(ids.reshape(-1)[p] == expert for p in pos)


def test_a_batch_without_lora_is_told_by_the_punica_flag():
    def ctx(flag):
        meta = types.SimpleNamespace(no_lora_flag_cpu=torch.tensor([flag]))
        return types.SimpleNamespace(punica_wrapper=types.SimpleNamespace(token_mapping_meta=meta))

    assert moe_lora.batch_has_lora(ctx(False))
    assert not moe_lora.batch_has_lora(ctx(True))
    # a wrapper without the flag: the decomposed path, which is right for either
    assert moe_lora.batch_has_lora(types.SimpleNamespace(punica_wrapper=object()))


@needs_aphrodite
def test_p5_leaves_a_layer_with_a_lora_capable_kernel_to_the_wrapper(overlay):
    """P5 declines an EXL3 MoE layer for LoRA unless its quant method offers a LoRA-capable ``moe_kernel`` (P13's):
    the live wrapper's own answer then stands."""
    from hybrid_exl3_fixes.aphrodite.lora.layers import fused_moe as p5

    overlay.apply_all()
    module = importlib.import_module(p5.MODULE)
    wrapper = module.FusedMoE3DWithLoRA
    layer = p5.stand_in_exl3_moe_layer()
    assert wrapper.can_replace_layer(layer, None, ["w13"]) is False  # no kernel: declined (P5)
    holder = getattr(layer, "routed_experts", layer)  # where FusedMoEWithLoRA reads the quant method
    # the stand-in was never initialised: the quant method set where an initialised layer has it (fake inputs)
    holder.__dict__["quant_method"] = types.SimpleNamespace(
        moe_kernel=types.SimpleNamespace(supports_lora=lambda: True)
    )
    assert p5.has_lora_kernel(layer)
    assert wrapper.can_replace_layer(layer, None, ["w13"]) is True  # the wrapper's own answer for a MoE layer
    holder.__dict__["quant_method"] = types.SimpleNamespace(moe_kernel=None)
    assert not p5.has_lora_kernel(layer)
    assert wrapper.can_replace_layer(layer, None, ["w13"]) is False


@needs_aphrodite
def test_p5_counts_only_the_exl3_moe_layers_no_wrapper_took():
    from hybrid_exl3_fixes.aphrodite.lora.layers import fused_moe as p5

    model = torch.nn.Module()
    model.add_module("unwrapped", p5.stand_in_exl3_moe_layer())
    wrapped = torch.nn.Module()
    wrapped.add_module("base_layer", p5.stand_in_exl3_moe_layer())
    model.add_module("wrapped", wrapped)
    assert p5.exl3_moe_names(model) == ["unwrapped"]


def wrapped_moe_block():
    """A MoE block as 0.21.0's LoRA manager leaves it mid-walk: ``mlp.experts`` already a LoRA wrapper, the old layer
    (its ``base_layer``) holding a ``runner`` whose ``gate`` aliases the block's router (fake inputs; the wrapper is
    a real ``BaseLayerWithLoRA``)."""
    from aphrodite.lora.layers import BaseLayerWithLoRA

    class Wrapper(BaseLayerWithLoRA):
        def __init__(self, base_layer):
            super().__init__()
            self.base_layer = base_layer

    root, mlp, experts, runner = (torch.nn.Module() for _ in range(4))
    runner.gate = torch.nn.Linear(2, 2)
    experts.runner = runner
    mlp.experts = Wrapper(experts)
    root.mlp = mlp
    return root, runner


@pytest.mark.skipif(not HAS_MIXIN, reason="0.20.0 has no LoRAExpertsMixin: P13 does not apply there")
def test_the_lora_manager_wraps_an_alias_below_a_wrapped_moe_layer(overlay, monkeypatch):
    """0.21.0 stops at start-up with "FusedMoE3DWithLoRA has no attribute `runner`" once P13 lets the MoE layer be
    wrapped (docs/upstream/lora-moe-runner-alias.md); with P13 the alias is replaced through the wrapper."""
    from aphrodite.lora import model_manager
    from aphrodite.lora.layers import BaseLayerWithLoRA

    root, runner = wrapped_moe_block()
    new = torch.nn.Linear(2, 2)
    if "__getattr__" in vars(BaseLayerWithLoRA):  # 0.24: the wrapper forwards a public miss to its base_layer
        assert model_manager.replace_submodule(root, "mlp.experts.runner.gate", new) is new
        assert runner.gate is new
        root, runner = wrapped_moe_block()
    else:  # the release's own replace_submodule stops at the wrapper
        with pytest.raises(AttributeError, match="runner"):
            model_manager.replace_submodule(root, "mlp.experts.runner.gate", new)
    monkeypatch.setenv(moe_lora.ENABLE_ENV, "1")
    result = {r.patch.id: r for r in overlay.apply_all()}["P13"]
    assert result.status.value == "APPLIED", result.reason
    assert model_manager.replace_submodule(root, "mlp.experts.runner.gate", new) is new
    assert runner.gate is new
    other = torch.nn.Linear(2, 2)  # a path the model resolves: the original's answer
    assert model_manager.replace_submodule(root, "mlp.experts", other) is other
    assert root.mlp.experts is other
    with pytest.raises(AttributeError):  # a path that exists nowhere still stops
        model_manager.replace_submodule(root, "mlp.nothing.gate", new)


def test_undo_takes_back_every_kernel_p13_gave(monkeypatch):
    """P13's on_undo: each method it gave a kernel has none again and each layer its own shape tensors back (fake
    inputs: a method and layers that only hold attributes; the kernel itself is a stand-in)."""
    import types

    monkeypatch.setattr(moe_lora, "_GIVEN", [])
    monkeypatch.setattr(moe_lora, "make_kernel", lambda method, layer: setattr(layer, "w13_weight", "view") or "kernel")
    method = types.SimpleNamespace(moe=types.SimpleNamespace(is_lora_enabled=True), moe_kernel=None)
    layer = types.SimpleNamespace()
    moe_lora.give_lora_kernel(method, layer)
    assert method.moe_kernel == "kernel"
    assert layer.w13_weight == "view"
    off = types.SimpleNamespace(moe=types.SimpleNamespace(is_lora_enabled=False), moe_kernel=None)
    moe_lora.give_lora_kernel(off, types.SimpleNamespace())  # LoRA off: nothing given, nothing to take back
    assert len(moe_lora._GIVEN) == 1
    moe_lora.reset_state()
    assert method.moe_kernel is None
    assert not hasattr(layer, "w13_weight")
    assert moe_lora._GIVEN == []
    assert moe_lora.PATCH.on_undo is moe_lora.reset_state
