"""P2 (overlay/aphrodite/lora/layers/utils.py) against the real aphrodite-engine modules (CPU): the LoRA device of
an EXL3 layer at every site that bound ``_get_lora_device``, dense layers on 0.20/0.21 and MoE layers on every
release."""

from __future__ import annotations

import pytest
import torch

from helpers import needs_aphrodite, needs_buggy, needs_fixed

pytestmark = needs_aphrodite


def exl3_base_layer():
    """A loaded EXL3 linear as the LoRA wrapper sees it (fake input: placeholders + one shard)."""
    from hybrid_exl3_fixes.shared import fake_exl3_layer

    layer = fake_exl3_layer()
    layer.input_size, layer.tp_size, layer.tp_rank = 256, 1, 0
    return layer


@needs_buggy
def test_p2_unpatched_fails_with_upstream_error(overlay):
    from aphrodite.lora.layers.base_linear import BaseLinearLayerWithLoRA

    with pytest.raises(ValueError, match=r"^Unsupported base layer: "):
        BaseLinearLayerWithLoRA(exl3_base_layer())


@needs_buggy
def test_p2_patched_lora_wrapper_takes_the_exl3_device(overlay):
    from aphrodite.lora.layers import base_linear, fused_moe, utils

    overlay.apply_all()
    layer = exl3_base_layer()
    wrapper = base_linear.BaseLinearLayerWithLoRA(layer)
    assert wrapper.device == layer.trellis.exl3_tensors[(0, 1, 2)].device
    # every binding site answers, the MoE one for an EXL3 MoE layer too
    moe = torch.nn.Module()
    moe.w2_trellis = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    moe.w2_trellis.exl3_tensors = {(0, "w2"): torch.zeros(2)}
    for site in (utils, base_linear, fused_moe):
        assert site._get_lora_device(layer) == torch.device("cpu")
        assert site._get_lora_device(moe) == torch.device("cpu")
    # non-EXL3 layers keep the upstream answers and errors
    dense = torch.nn.Linear(4, 4)
    assert utils._get_lora_device(dense) == dense.weight.device
    with pytest.raises(ValueError, match="Unsupported base layer"):
        utils._get_lora_device(torch.nn.Module())


@needs_fixed
def test_fixed_release_still_rejects_exl3_moe_for_lora():
    """Evidence for docs/upstream/exl3-moe-lora-device.md: #1712 checks ``trellis`` only, while
    Exl3MoEMethod registers ``w13_trellis``/``w2_trellis``. When this starts failing, upstream
    fixed it: update the write-up."""
    from aphrodite.lora.layers.utils import _get_lora_device

    moe = torch.nn.Module()
    moe.w2_trellis = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    moe.w2_trellis.exl3_tensors = {(0, "w2"): torch.zeros(2)}
    with pytest.raises(ValueError, match="^Unsupported base layer"):
        _get_lora_device(moe)


@needs_aphrodite
@pytest.mark.parametrize("routed_experts", [False, True], ids=["flat (0.20/0.21)", "routed_experts (0.22+)"])
def test_p2_gives_exl3_moe_layers_their_device_on_every_release(overlay, routed_experts):
    """The MoE branch the upstream fix lacks: with P2, an EXL3 MoE layer in either form gets the device
    its expert tensors live on, at every site that bound the function, on every release."""
    from aphrodite.lora.layers import base_linear, fused_moe, utils

    from hybrid_exl3_fixes.aphrodite.lora.layers.utils import PATCH
    from hybrid_exl3_fixes.shared import fake_exl3_moe_layer

    layer = fake_exl3_moe_layer("meta", routed_experts=routed_experts)
    with pytest.raises(ValueError, match="^Unsupported base layer"):  # unpatched: every release rejects it
        utils._get_lora_device(layer)
    assert overlay.REGISTRY.apply(PATCH).status.value == "APPLIED"
    for site in (utils, base_linear, fused_moe):
        assert site._get_lora_device(layer) == torch.device("meta")
