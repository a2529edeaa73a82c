"""P2b (overlay/aphrodite/lora/layers/base_linear.py) against the real aphrodite-engine modules (CPU): the LoRA
wrapper's ``weight`` property answers for an EXL3 base layer."""

from __future__ import annotations

import torch
from test_p2_lora_layers_utils import exl3_base_layer

from helpers import needs_aphrodite, needs_buggy

pytestmark = needs_aphrodite


@needs_buggy
def test_p2b_weight_property(overlay):
    from aphrodite.lora.layers.base_linear import BaseLinearLayerWithLoRA

    overlay.apply_all()
    layer = exl3_base_layer()
    wrapper = BaseLinearLayerWithLoRA(layer)
    assert wrapper.weight is layer.trellis
    wrapper_dense = BaseLinearLayerWithLoRA(_dense_base())
    assert wrapper_dense.weight is wrapper_dense.base_layer.weight


def _dense_base():
    layer = torch.nn.Linear(4, 4)
    layer.input_size, layer.tp_size, layer.tp_rank = 4, 1, 0
    return layer
