"""P14 (the MoE-LoRA align kernel of 0.20 - 0.21 and the last adapter slot of a batch with base tokens) against the
real aphrodite-engine modules of the lane's release (CPU).

The token-to-slot metadata is aphrodite's own ``LoRAKernelMeta`` and the op is aphrodite's own
``_custom_ops.moe_lora_align_block_size``. What the CPU lacks is the compiled kernel behind it: ``port_of_the_launch``
is what the 0.20 - 0.21 kernel library writes (``csrc/moe/moe_align_sum_kernels.cu`` as of dphnAI/sonar 8c233874c,
unchanged through 0.21.0: one block per entry of ``lora_ids[:max_loras]``, each aligning its slot's (token, expert)
pairs per expert, padded to ``block_size``), registered as ``_moe_C::moe_lora_align_block_size`` for the CPU while
a test runs, and only where no build of the op is loaded. The GPU drop-in
(tests/upstream/tests/lora/test_moe_lora_align_every_active_slot.py) checks the compiled kernel itself."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import APHRODITE_VERSION, needs_aphrodite

pytestmark = needs_aphrodite

MODULE = "hybrid_exl3_fixes.aphrodite._custom_ops"
OLD_KERNELS = ("0.20.0", "0.21.0")  # the releases whose kernel library is aphrodite._moe_C
needs_old_kernels = pytest.mark.skipif(
    APHRODITE_VERSION not in OLD_KERNELS,
    reason=f"aphrodite {APHRODITE_VERSION} builds its MoE ops from csrc/libtorch_stable (0.22+), which launches "
    "the align kernel over every entry of lora_ids",
)
SCHEMA = (
    "moe_lora_align_block_size(Tensor topk_ids, Tensor token_lora_mapping, int num_experts, int block_size, "
    "int max_loras, int max_num_tokens_padded, int max_num_m_blocks, Tensor(a!) sorted_token_ids, "
    "Tensor(b!) experts_ids, Tensor(c!) num_tokens_post_pad, Tensor adapter_enabled, Tensor lora_ids, "
    "Tensor? maybe_expert_map=None) -> ()"
)
EXPERTS, TOP_K, BLOCK = 4, 2, 16
SENTINEL = -7


def p14():
    import importlib

    return importlib.import_module(MODULE)


def port_of_the_launch(
    topk_ids, token_lora_mapping, num_experts, block_size, max_loras, max_num_tokens_padded, max_num_m_blocks,
    sorted_token_ids, experts_ids, num_tokens_post_pad, adapter_enabled, lora_ids, maybe_expert_map=None,
):  # fmt: skip
    """The 0.20 - 0.21 kernels' result on the CPU (module docstring): blocks for ``lora_ids[:max_loras]`` only."""
    flat, top_k = topk_ids.reshape(-1).tolist(), topk_ids.shape[1]
    sorted_rows = sorted_token_ids.view(max_loras, -1)
    expert_rows = experts_ids.view(max_loras, -1)
    for lora_idx in range(max_loras):  # kernel<<<max_loras, ...>>>
        lora = int(lora_ids[lora_idx])
        if lora == -1 or int(adapter_enabled[lora]) == 0:
            continue
        sorted_rows[lora].fill_(len(flat))
        expert_rows[lora].fill_(-1)
        start = 0
        for expert in range(num_experts):
            pairs = [i for i, e in enumerate(flat) if e == expert and int(token_lora_mapping[i // top_k]) == lora]
            padded = math.ceil(len(pairs) / block_size) * block_size
            sorted_rows[lora, start : start + len(pairs)] = torch.tensor(pairs, dtype=torch.int32)
            expert_rows[lora, start // block_size : (start + padded) // block_size] = expert
            start += padded
        num_tokens_post_pad[lora] = start


@pytest.fixture
def old_kernel():
    """``port_of_the_launch`` as the CPU build of ``_moe_C::moe_lora_align_block_size``, for this test only."""
    if hasattr(torch.ops._moe_C, "moe_lora_align_block_size"):
        pytest.skip("a build of _moe_C::moe_lora_align_block_size is loaded here; the GPU drop-in tests that one")
    lib = torch.library.Library("_moe_C", "FRAGMENT")
    lib.define(SCHEMA)
    lib.impl("moe_lora_align_block_size", port_of_the_launch, "CPU")
    yield
    lib._destroy()


def batch(max_loras: int, tokens_per_slot: int = 3, base_tokens: int = 2):
    """A batch of base-model tokens and ``tokens_per_slot`` tokens of every adapter slot, its routing and the
    ``lora_ids`` aphrodite's own metadata gives the align op for it (``LoRAKernelMeta``, as the punica wrapper)."""
    from aphrodite.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

    mapping = [-1] * base_tokens + [slot for slot in range(max_loras) for _ in range(tokens_per_slot)]
    gen = torch.Generator().manual_seed(max_loras)
    topk_ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in mapping]).to(torch.int32)
    meta = LoRAKernelMeta.make(max_loras, 64, "cpu")
    meta.prepare_tensors(torch.tensor(mapping, dtype=torch.int32))
    token_lora_mapping, _, _, _, lora_ids, _, _ = meta.meta_args(len(mapping), False)
    return topk_ids, token_lora_mapping, lora_ids


def align(max_loras: int):
    """aphrodite's ``_custom_ops.moe_lora_align_block_size`` on ``batch(max_loras)``, output buffers as the punica
    wrapper sizes them, filled with a sentinel; returns (per-slot post-pad counts, sorted rows, expert rows, batch)."""
    from aphrodite import _custom_ops as ops

    topk_ids, token_lora_mapping, lora_ids = batch(max_loras)
    padded = topk_ids.numel() + EXPERTS * (BLOCK - 1)
    blocks = math.ceil(padded / BLOCK)
    sorted_ids = torch.full((max_loras * padded,), SENTINEL, dtype=torch.int32)
    expert_ids = torch.full((max_loras * blocks,), SENTINEL, dtype=torch.int32)
    post_pad = torch.full((max_loras,), SENTINEL, dtype=torch.int32)
    enabled = torch.ones(max_loras + 1, dtype=torch.int32)
    ops.moe_lora_align_block_size(
        topk_ids, token_lora_mapping, EXPERTS, BLOCK, max_loras, padded, blocks, sorted_ids, expert_ids, post_pad,
        enabled, lora_ids,
    )  # fmt: skip
    return post_pad, sorted_ids.view(max_loras, -1), expert_ids.view(max_loras, -1), (topk_ids, token_lora_mapping)


def slot_pairs(slot: int, topk_ids, token_lora_mapping) -> set[int]:
    top_k = topk_ids.shape[1]
    return {i for i in range(topk_ids.numel()) if int(token_lora_mapping[i // top_k]) == slot}


@pytest.mark.parametrize("max_loras", [1, 2, 4])
def test_aphrodites_metadata_puts_the_base_slot_first(max_loras):
    """Every release: with base tokens and ``max_loras`` adapters, the ids hold -1 first, so the first ``max_loras``
    entries (all a 0.20 - 0.21 launch reads) miss the last slot."""
    _, _, lora_ids = batch(max_loras)
    assert lora_ids.tolist() == [-1, *range(max_loras)]
    assert max_loras - 1 not in lora_ids[:max_loras].tolist()


@needs_old_kernels
@pytest.mark.parametrize("max_loras", [1, 2, 4])
def test_the_release_never_aligns_the_last_slot(overlay, old_kernel, max_loras):
    """Unpatched, the last slot's rows stay as they were (on the GPU: as ``torch.empty`` left them)."""
    overlay.undo_all()
    post_pad, sorted_rows, expert_rows, _ = align(max_loras)
    last = max_loras - 1
    assert int(post_pad[last]) == SENTINEL
    assert (sorted_rows[last] == SENTINEL).all() and (expert_rows[last] == SENTINEL).all()


@needs_old_kernels
@pytest.mark.parametrize("max_loras", [1, 2, 4])
def test_with_the_overlay_every_active_slot_is_aligned(overlay, old_kernel, max_loras):
    """With P14, each slot's row holds exactly its own (token, expert) pairs, grouped by expert into padded blocks
    whose expert id is the one every pair in them was routed to."""
    results = {r.patch.id: r for r in overlay.apply_all()}
    assert results["P14"].status.value == "APPLIED", results["P14"].reason
    post_pad, sorted_rows, expert_rows, (topk_ids, token_lora_mapping) = align(max_loras)
    flat = topk_ids.reshape(-1)
    for slot in range(max_loras):
        count = int(post_pad[slot])
        assert count > 0 and count % BLOCK == 0, (slot, count)
        row = sorted_rows[slot, :count]
        pairs = row[row != topk_ids.numel()]
        assert set(pairs.tolist()) == slot_pairs(slot, topk_ids, token_lora_mapping)
        for block, expert in enumerate(expert_rows[slot, : count // BLOCK].tolist()):
            members = row[block * BLOCK : (block + 1) * BLOCK]
            members = members[members != topk_ids.numel()]
            assert (flat[members.long()] == expert).all(), (slot, block)


def test_active_slots_first_keeps_every_id_and_their_order():
    order = p14().active_slots_first
    cases = {(-1, 0, 1): [0, 1, -1], (0, 1, -1): [0, 1, -1], (-1, 2, -1, -1): [2, -1, -1, -1], (-1, -1): [-1, -1]}
    for ids, expected in cases.items():
        tensor = torch.tensor(ids, dtype=torch.int32)
        out = order(tensor)
        assert out.tolist() == expected and out.dtype == tensor.dtype
        assert tensor.tolist() == list(ids)  # the metadata's own tensor is left as it is


def test_the_wrapper_changes_lora_ids_alone():
    """Positional (as the punica wrapper calls it) and by keyword: every other argument reaches the op as given."""
    seen = []
    wrapped = p14().build_align(lambda *args, **kwargs: seen.append((args, kwargs)))
    ids = torch.tensor([-1, 0, 1], dtype=torch.int32)
    others = [object() for _ in range(11)]
    wrapped(*others, ids, None)
    args, kwargs = seen[-1]
    assert args[:11] == tuple(others) and args[12] is None and kwargs == {}
    assert args[11].tolist() == [0, 1, -1]
    wrapped(*others, lora_ids=ids)
    assert seen[-1][1]["lora_ids"].tolist() == [0, 1, -1]


def test_the_probe_reads_which_kernel_library_the_release_loads(overlay):
    """0.20 - 0.21 load ``aphrodite._moe_C`` (APPLIED), 0.22+ ``aphrodite._moe_C_stable_libtorch`` (UPSTREAM_FIXED,
    the op left as it is)."""
    from aphrodite import _custom_ops as ops

    original = ops.moe_lora_align_block_size
    results = {r.patch.id: r for r in overlay.apply_all()}
    if APHRODITE_VERSION in OLD_KERNELS:
        assert p14().moe_kernel_library() == "aphrodite._moe_C"
        assert results["P14"].status.value == "APPLIED"
        assert ops.moe_lora_align_block_size is not original
    else:
        assert p14().moe_kernel_library() == "aphrodite._moe_C_stable_libtorch"
        assert results["P14"].status.value == "UPSTREAM_FIXED"
        assert ops.moe_lora_align_block_size is original
