# SPDX-License-Identifier: Apache-2.0
"""EXL3 shard ids for fused projections (drop-in for aphrodite's tests/quantization/).

With LoRA enabled, Qwen3.5/3.6 GatedDeltaNet layers keep in_proj_qkv as its own merged linear
and qwen3_5.py loads the fused checkpoint tensor with the single shard id (0, 1, 2).
"""

from types import SimpleNamespace

import pytest
from aphrodite.model_executor.layers.quantization.exl3 import Exl3Config, Exl3LinearMethod


@pytest.fixture
def method():
    return Exl3LinearMethod(Exl3Config(bits=4.0, head_bits=None, tensor_storage={}))


def test_gdn_in_proj_qkv_lora_path_is_one_fused_shard(method):
    layer = SimpleNamespace(prefix="language_model.model.layers.0.linear_attn.in_proj_qkv")
    assert method._shard_ids_for_layer(layer, [256, 256, 512]) == [(0, 1, 2)]


@pytest.mark.parametrize(
    "prefix,sizes,expected",
    [
        ("model.layers.3.self_attn.qkv_proj", [512, 256, 256], ["q", "k", "v"]),
        ("model.layers.0.mlp.gate_up_proj", [512, 512], [0, 1]),
        ("model.layers.0.linear_attn.in_proj_qkvz", [256, 256, 512, 512], [(0, 1, 2), 3]),
        ("model.layers.0.linear_attn.in_proj_qkv", [1024], [None]),
        ("model.layers.0.self_attn.o_proj", [256], [None]),
    ],
)
def test_other_projections_unchanged(method, prefix, sizes, expected):
    assert method._shard_ids_for_layer(SimpleNamespace(prefix=prefix), sizes) == expected
