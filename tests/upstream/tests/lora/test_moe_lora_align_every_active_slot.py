# SPDX-License-Identifier: Apache-2.0
"""Every active LoRA slot aligned by moe_lora_align_block_size (drop-in for aphrodite's tests/lora/).

The punica wrapper hands the op ``lora_ids`` = ``LoRAKernelMeta.active_lora_ids``: the batch's distinct slots sorted,
-1 (base-model tokens) first, then -1, max_loras + 1 entries. With base tokens and max_loras adapters in one batch
the last slot sits at index max_loras; a launch of max_loras blocks (0.20 - 0.21's kernels) never aligns it, and its
output rows stay as they were. Both forms of the op: small batches (fewer than 1,024 (token, expert) pairs and at
most 64 experts) and the large one.
"""

import math

import pytest
import torch
from aphrodite import _custom_ops as ops
from aphrodite.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the align kernels need CUDA")

SENTINEL = -7
TOP_K, BLOCK = 2, 16


@pytest.mark.parametrize("max_loras", [1, 2, 4])
@pytest.mark.parametrize("experts, tokens_per_slot", [(8, 3), (8, 300), (128, 3)], ids=["small", "large", "many"])
def test_every_active_slot_is_aligned_beside_base_tokens(max_loras, experts, tokens_per_slot):
    mapping = [-1] * 5 + [slot for slot in range(max_loras) for _ in range(tokens_per_slot)]
    gen = torch.Generator(device="cuda").manual_seed(max_loras)
    topk_ids = torch.stack([torch.randperm(experts, generator=gen, device="cuda")[:TOP_K] for _ in mapping]).to(
        torch.int32
    )
    meta = LoRAKernelMeta.make(max_loras, len(mapping), "cuda")
    meta.prepare_tensors(torch.tensor(mapping, dtype=torch.int32, device="cuda"))
    token_lora_mapping, _, _, _, lora_ids, _, _ = meta.meta_args(len(mapping), False)
    assert lora_ids.tolist() == [-1, *range(max_loras)]

    numel = topk_ids.numel()
    padded = numel + experts * (BLOCK - 1)
    if numel < experts:
        padded = numel * BLOCK
    blocks = math.ceil(padded / BLOCK)
    sorted_ids = torch.full((max_loras * padded,), SENTINEL, dtype=torch.int32, device="cuda")
    expert_ids = torch.full((max_loras * blocks,), SENTINEL, dtype=torch.int32, device="cuda")
    post_pad = torch.full((max_loras,), SENTINEL, dtype=torch.int32, device="cuda")
    enabled = torch.ones(max_loras + 1, dtype=torch.int32, device="cuda")
    ops.moe_lora_align_block_size(
        topk_ids, token_lora_mapping, experts, BLOCK, max_loras, padded, blocks, sorted_ids, expert_ids, post_pad,
        enabled, lora_ids,
    )  # fmt: skip
    torch.cuda.synchronize()

    flat = topk_ids.view(-1).cpu()
    sorted_rows, expert_rows = sorted_ids.view(max_loras, -1).cpu(), expert_ids.view(max_loras, -1).cpu()
    for slot in range(max_loras):
        count = int(post_pad[slot])
        assert count != SENTINEL, f"slot {slot} of {max_loras} was never aligned"
        assert 0 < count <= padded and count % BLOCK == 0, (slot, count)
        row = sorted_rows[slot, :count]
        pairs = row[row != numel]
        wanted = {i for i in range(numel) if mapping[i // TOP_K] == slot}
        assert set(pairs.tolist()) == wanted, f"slot {slot}: its (token, expert) pairs"
        for block, expert in enumerate(expert_rows[slot, : count // BLOCK].tolist()):
            members = row[block * BLOCK : (block + 1) * BLOCK]
            members = members[members != numel]
            if members.numel():
                assert (flat[members.long()] == expert).all(), (slot, block)
