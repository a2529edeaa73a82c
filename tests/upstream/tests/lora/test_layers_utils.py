# SPDX-License-Identifier: Apache-2.0
"""LoRA on EXL3 base layers (drop-in for aphrodite's tests/lora/test_layers_utils.py)."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from aphrodite.lora.layers import base_linear, fused_moe, utils

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _placeholder(shards: dict) -> nn.Parameter:
    # The shape of Exl3Parameter: an empty tensor plus the loaded shards.
    param = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=DEVICE), requires_grad=False)
    param.exl3_tensors = shards
    return param


def _exl3_linear(loaded: bool = True) -> nn.Module:
    layer = nn.Module()
    shard = {(0, 1, 2): torch.zeros(16, 16, 48, dtype=torch.int16, device=DEVICE)} if loaded else {}
    for name in ("suh", "svh", "mcg", "mul1"):
        layer.register_parameter(name, _placeholder({}))
    layer.register_parameter("trellis", _placeholder(shard))
    layer.input_size, layer.tp_size, layer.tp_rank = 256, 1, 0
    layer.prefix = "model.layers.0.linear_attn.in_proj_qkv"
    return layer


def _exl3_moe() -> nn.Module:
    layer = nn.Module()
    layer.register_parameter("w13_trellis", _placeholder({(0, "w1"): torch.zeros(2, device=DEVICE)}))
    layer.register_parameter("w2_trellis", _placeholder({(0, "w2"): torch.zeros(2, device=DEVICE)}))
    return layer


# base_linear and fused_moe import _get_lora_device by name: each call site must see the fix.
@pytest.mark.parametrize("site", [utils, base_linear, fused_moe], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
@pytest.mark.parametrize("make_layer", [_exl3_linear, _exl3_moe], ids=["linear", "moe"])
def test_get_lora_device_exl3(site, make_layer):
    expected = torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    assert site._get_lora_device(make_layer()) == expected


def test_get_lora_device_exl3_before_loading():
    # EXL3 is CUDA-only: before loading, the shards are headed for the current CUDA device.
    # Without CUDA there is no device to name; the layer must still be recognised.
    with contextlib.suppress(RuntimeError, AssertionError):
        assert utils._get_lora_device(_exl3_linear(loaded=False)).type == "cuda"


def test_get_lora_device_unknown_layer_still_rejected():
    with pytest.raises(ValueError, match="Unsupported base layer"):
        utils._get_lora_device(nn.Module())


def test_lora_wrapper_weight_on_exl3_layer():
    layer = _exl3_linear()
    assert base_linear.BaseLinearLayerWithLoRA.weight.fget(SimpleNamespace(base_layer=layer)) is layer.trellis


@pytest.mark.skipif(not torch.cuda.is_available(), reason="EXL3 layers live on CUDA; the wrapper asks for that device")
def test_lora_wrapper_on_exl3_layer():
    layer = _exl3_linear()
    wrapper = base_linear.BaseLinearLayerWithLoRA(layer)
    assert wrapper.device == layer.trellis.exl3_tensors[(0, 1, 2)].device
    assert wrapper.weight is layer.trellis
