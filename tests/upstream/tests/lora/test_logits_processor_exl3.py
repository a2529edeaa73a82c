# SPDX-License-Identifier: Apache-2.0
"""The LoRA logits-processor wrapper for an EXL3 lm_head (drop-in for aphrodite's tests/lora/)."""

import socket

import pytest
import torch
import torch.nn as nn
from aphrodite.config import AphroditeConfig, DeviceConfig, set_current_aphrodite_config
from aphrodite.config.lora import LoRAConfig
from aphrodite.distributed import parallel_state
from aphrodite.lora import model_manager
from aphrodite.lora.layers import LogitsProcessorWithLoRA
from aphrodite.model_executor.layers.logits_processor import LogitsProcessor
from aphrodite.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tp_group_of_one():
    """aphrodite's TP group of one process (gloo), as the LoRA wrappers look it up."""
    if parallel_state.model_parallel_is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_aphrodite_config(AphroditeConfig(device_config=DeviceConfig(device=DEVICE))):
        parallel_state.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        parallel_state.initialize_model_parallel(1, 1)
        yield
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


def _placeholder(shards: dict) -> nn.Parameter:
    # The shape of Exl3Parameter: an empty tensor plus the loaded shards.
    param = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=DEVICE), requires_grad=False)
    param.exl3_tensors = shards
    return param


def _exl3_lm_head(vocab: int = 256, hidden: int = 128) -> ParallelLMHead:
    # ParallelLMHead as Exl3LinearMethod.create_weights leaves it once loaded: no weight, the placeholders.
    head = ParallelLMHead(vocab, hidden, prefix="lm_head")
    del head.weight
    shard = torch.zeros(hidden // 16, vocab // 16, 96, dtype=torch.int16, device=DEVICE)
    for name in ("suh", "svh", "mcg", "mul1"):
        head.register_parameter(name, _placeholder({}))
    head.register_parameter("trellis", _placeholder({None: shard}))
    return head


def test_logits_processor_lora_for_exl3_lm_head(tp_group_of_one):
    config = LoRAConfig(max_lora_rank=8, max_loras=2, lora_dtype=torch.bfloat16)
    wrapper = model_manager.from_layer_logits_processor(LogitsProcessor(256), _exl3_lm_head(), 2, config, None)
    assert isinstance(wrapper, LogitsProcessorWithLoRA)
    assert wrapper.dtype == torch.bfloat16 and wrapper.device.type == DEVICE
    assert wrapper.lora_a_stacked.shape == (2, 1, 8, 128)
    assert wrapper.lora_b_stacked.shape == (2, 1, 256, 8)
    assert wrapper.lora_b_stacked.device.type == DEVICE


def test_logits_processor_lora_for_unquantized_lm_head(tp_group_of_one):
    config = LoRAConfig(max_lora_rank=8, max_loras=1, lora_dtype=torch.bfloat16)
    head = ParallelLMHead(256, 128, prefix="lm_head")
    wrapper = model_manager.from_layer_logits_processor(LogitsProcessor(256), head, 1, config, None)
    assert wrapper.dtype == head.weight.dtype and wrapper.device == head.weight.device
