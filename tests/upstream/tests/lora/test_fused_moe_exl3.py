# SPDX-License-Identifier: Apache-2.0
"""LoRA with EXL3 MoE layers (drop-in for aphrodite's tests/lora/): the layers stay unwrapped, adapters
on their routed experts are refused with the modules named."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from aphrodite.config.lora import LoRAConfig
from aphrodite.lora.layers import fused_moe
from aphrodite.lora.lora_model import LoRAModel
from aphrodite.lora.request import LoRARequest
from aphrodite.lora.worker_manager import WorkerLoRAManager
from safetensors.torch import save_file

MOE = getattr(fused_moe, "MoERunner", None) or fused_moe.FusedMoE


def _exl3_moe() -> nn.Module:
    """A FusedMoE (MoERunner from 0.22) as Exl3MoEMethod leaves it: w13_*/w2_* placeholders (on
    routed_experts from 0.22). Built without the constructor, which needs the parallel config."""
    layer = object.__new__(MOE)
    nn.Module.__init__(layer)
    holder = layer
    if fused_moe.__dict__.get("MoERunner") is not None:
        holder = layer.routed_experts = nn.Module()
    for name in ("w13_trellis", "w2_trellis"):
        holder.register_parameter(name, nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False))
    if holder is not layer:  # the upstream fix of 0.20/0.21 reads the layer itself
        for name in ("w13_trellis", "w2_trellis"):
            layer.register_parameter(name, getattr(holder, name))
    return layer


@pytest.mark.parametrize(
    "cls, packed", [(fused_moe.FusedMoEWithLoRA, ["w1", "w3"]), (fused_moe.FusedMoE3DWithLoRA, ["w13"])]
)
def test_exl3_moe_layer_is_not_wrapped(cls, packed):
    assert cls.can_replace_layer(_exl3_moe(), None, packed) is False


def test_plain_moe_layer_is_still_wrapped():
    layer = object.__new__(MOE)
    nn.Module.__init__(layer)
    assert fused_moe.FusedMoEWithLoRA.can_replace_layer(layer, None, ["w1", "w3"]) is True


def _adapter(path, experts: bool):
    """A PEFT adapter over one attention projection and, with ``experts``, expert 0's projections."""
    path.mkdir()
    modules = ["model.layers.0.self_attn.o_proj"]
    if experts:
        modules += [f"model.layers.0.mlp.experts.0.{w}" for w in ("gate_proj", "up_proj", "down_proj")]
    state = {}
    for m in modules:
        state[f"base_model.model.{m}.lora_A.weight"] = torch.zeros(8, 64)
        state[f"base_model.model.{m}.lora_B.weight"] = torch.zeros(64, 8)
    save_file(state, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["o_proj", "gate_proj"]})
    )
    return str(path)


def _manager(model: nn.Module) -> WorkerLoRAManager:
    """The worker's LoRA manager over ``model``, with the state _load_adapter reads (the constructor
    needs a whole engine config)."""
    manager = object.__new__(WorkerLoRAManager)
    manager._adapter_manager = SimpleNamespace(
        model=model,
        supported_lora_modules=["o_proj", "experts"],
        packed_modules_mapping={
            "experts": [f"experts.0.{w}" for w in ("gate_proj", "up_proj", "down_proj")],
        },
    )
    manager.lora_config = LoRAConfig(max_lora_rank=8, max_loras=1)
    manager.max_position_embeddings = 4096
    manager.vocab_size = 512
    manager._lora_model_cls = LoRAModel
    return manager


def test_adapter_on_exl3_experts_is_refused_naming_the_modules(tmp_path):
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].mlp = nn.Module()
    model.layers[0].mlp.experts = _exl3_moe()
    path = _adapter(tmp_path / "experts", experts=True)
    with pytest.raises(ValueError, match=r"mlp\.experts\.0\.gate_proj"):
        _manager(model)._load_adapter(LoRARequest("experts", 1, path))
