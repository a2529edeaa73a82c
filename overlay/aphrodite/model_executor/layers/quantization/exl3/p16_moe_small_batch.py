"""P16: EXL3 routed experts at 2 - 32 tokens in one multi-matrix GEMM per projection, not one token at a time.

Target: ``aphrodite/model_executor/layers/quantization/exl3.py``.

Why:     ``Exl3MoEMethod.apply`` sends a batch of 2 to ``exl3_small_batch_threshold`` tokens (min(experts // top_k,
         32): 32 for the 35B-A3B, so every decode step of 2 - 32 requests) to ``_apply_small_batch``, a Python loop
         over the tokens that launches four kernels and a copy per token and layer, each over one token's top_k
         experts (``for i in range(x_2d.shape[0]): ... ops.exl3_mgemm(x_3d[i], ...)``, 0.20.0 - 0.24.1). A CUDA
         graph removes the launch cost, not the serial order, and one token's 8 experts do not fill the GPU, so the
         MoE part of the step is N times the one-token MoE: the 35B-A3B's decode step grows 1.72 ms a sequence
         against exllamav3's 0.83 (docs/upstream/exl3-moe-small-batch-per-token.md).
How:     ``ops.exl3_mgemm`` already takes one input row per matrix slot (``A[j] @ B[indices[j]] -> C[j]``, the slots
         looped over by the kernel's grid z, csrc/quantization/exl3/exllamav3_ext/quant/exl3_gemm_kernel.cuh). So
         every token's experts go into one call per projection: the N x top_k slots get their token's row (one
         copy), gate and up in one call where the release fuses them (``make_gate_up_indices`` over all slots) or
         two, ``silu_mul``, down without router weights (each slot's result kept), then the router-weighted sum
         of each token's slots in float32. Three or four kernels and two small ones a layer, whatever N; their
         buffers (6.8 MiB at the 35B-A3B's 32 x 8 slots) come from the caching allocator per call, as the release's
         grouped path takes its own (in a CUDA graph: from the graph's pool). A layer without the release's pointer
         tables goes to the original.
Probe:   the live ``_apply_small_batch`` (its source, read with ``inspect``) calls ``exl3_mgemm`` inside a ``for``
         loop; NOT_APPLICABLE where the release has no such method; after apply, the tag on the replacement.
Upstream: not reported yet; the upstream-ready diff is patches/0016-exl3-moe-small-batch-per-token.patch.
Retire when: an aphrodite release serves 2 - 32 EXL3 MoE tokens without a per-token loop and is the oldest
         supported one.
"""

from __future__ import annotations

import ast
from typing import Any

from hybrid_exl3_fixes.registry import MARKER, Live, NotApplicable, Patch, Target, tag
from hybrid_exl3_fixes.shared import MODULE, source_tree

MOE_SMALL_BATCH = Target(
    MODULE,
    "Exl3MoEMethod._apply_small_batch",
    params=("self", "layer", "x_2d", "topk_ids", "topk_weights", "original_dtype", "original_shape"),
)

# the pointer tables and flags _setup_fused_moe_kernel leaves on a loaded layer (0.20.0 - 0.24.1); 0.21+ add the
# fused gate-up tables, used where ``exl3_fuse_gate_up`` says so
LAYER_TABLES = (
    "exl3_gate_ptrs_trellis",
    "exl3_up_ptrs_trellis",
    "exl3_down_ptrs_trellis",
    "exl3_moe_k_gate",
    "exl3_moe_k_up",
    "exl3_moe_k_down",
)


def loops_over_tokens(function) -> bool:
    """True when ``function``'s source calls ``exl3_mgemm`` inside a ``for`` loop (one launch per token)."""
    tree = source_tree(function, "Exl3MoEMethod._apply_small_batch")
    return any(
        isinstance(node, ast.For)
        and any(isinstance(n, ast.Attribute) and n.attr == "exl3_mgemm" for b in node.body for n in ast.walk(b))
        for node in ast.walk(tree)
    )


def probe_moe_small_batch(live: dict[str, Live]) -> bool:
    """True = buggy: the release's small-batch path launches the experts' kernels once per token."""
    entry = live[MOE_SMALL_BATCH.key]
    function = entry.function
    if function is None:
        raise NotApplicable("this release's Exl3MoEMethod has no _apply_small_batch")
    if getattr(function, MARKER, None) == "P16":
        return False
    return loops_over_tokens(function)


def intermediate_size(layer: Any) -> int:
    size = getattr(layer, "exl3_intermediate_size_per_partition", None)
    if size is None:  # 0.20: read from the loaded trellis, as _setup_fused_moe_kernel does
        size = layer.w13_trellis.exl3_tensors[(0, "w1")].shape[1] * 16
    return int(size)


def call_bytes(rows: int, top_k: int, hidden: int, intermediate: int) -> int:
    """What one call allocates at most (fused gate-up): the 2 x slots input rows and their Hadamard scratch in float16,
    gate and up outputs and the activation in float16, the float32 down outputs, the int64 gate-up ids."""
    slots = rows * top_k
    float16 = 2 * 2 * slots * hidden + 2 * slots * intermediate + slots * intermediate
    return 2 * float16 + 4 * slots * hidden + 8 * 2 * slots


def batched_small_batch(ops, layer, x_2d, topk_ids, topk_weights, original_dtype, original_shape):
    """Every token's top_k experts through one ``exl3_mgemm`` per projection (see How)."""
    import torch

    rows, top_k = topk_ids.shape
    slots, hidden = rows * top_k, int(layer.hidden_size)
    fused = bool(getattr(layer, "exl3_fuse_gate_up", False)) and hasattr(ops, "make_gate_up_indices")
    copies = 2 if fused else 1  # the fused call reads one input row per gate slot and per up slot
    half = {"dtype": torch.float16, "device": x_2d.device}
    a = x_2d.view(1, rows, 1, hidden).expand(copies, rows, top_k, hidden).reshape(copies * slots, 1, hidden)
    a_had = torch.empty_like(a)
    ids = topk_ids.reshape(1, slots)
    gate_up = torch.empty((2 * slots, 1, intermediate_size(layer)), **half)
    gate, up = gate_up[:slots], gate_up[slots:]
    if fused:
        gate_up_ids = torch.empty((1, 2 * slots), dtype=torch.long, device=x_2d.device)
        ops.make_gate_up_indices(gate_up_ids, ids, layer.local_num_experts)
        ops.exl3_mgemm(
            a, layer.exl3_gate_up_ptrs_trellis, gate_up, layer.exl3_gate_up_ptrs_suh, a_had,
            layer.exl3_gate_up_ptrs_svh, gate_up_ids, None, layer.exl3_moe_k_gate, -1,
            layer.exl3_gate_mcg, layer.exl3_gate_mul1, -1, -1, 0,
        )  # fmt: skip
    else:
        for name, out, k in (("gate", gate, layer.exl3_moe_k_gate), ("up", up, layer.exl3_moe_k_up)):
            ops.exl3_mgemm(
                a, getattr(layer, f"exl3_{name}_ptrs_trellis"), out, getattr(layer, f"exl3_{name}_ptrs_suh"), a_had,
                getattr(layer, f"exl3_{name}_ptrs_svh"), ids, None, k, -1,
                getattr(layer, f"exl3_{name}_mcg"), getattr(layer, f"exl3_{name}_mul1"), -1, -1, 0,
            )  # fmt: skip
    act = torch.empty_like(gate)
    if hasattr(ops, "silu_mul"):
        ops.silu_mul(act, gate, up)
    else:  # 0.20
        act.copy_(torch.nn.functional.silu(gate) * up)
    down = torch.empty((slots, 1, hidden), dtype=torch.float32, device=x_2d.device)
    ops.exl3_mgemm(
        act, layer.exl3_down_ptrs_trellis, down, layer.exl3_down_ptrs_suh, act, layer.exl3_down_ptrs_svh, ids,
        None, layer.exl3_moe_k_down, -1, layer.exl3_down_mcg, layer.exl3_down_mul1, -1, -1, 0,
    )  # fmt: skip
    weights = topk_weights.reshape(rows, top_k, 1).to(torch.float32)
    output = (down.view(rows, top_k, hidden) * weights).sum(dim=1)
    if output.dtype != original_dtype:
        output = output.to(original_dtype)
    return output.reshape(*original_shape, hidden)


def build_moe_small_batch(live: dict[str, Live]) -> dict[str, Any]:
    original = live[MOE_SMALL_BATCH.key].function
    ops = original.__globals__["ops"]  # the release module's own aphrodite._custom_ops

    def _apply_small_batch(self, layer, x_2d, topk_ids, topk_weights, original_dtype, original_shape):
        if topk_ids.dim() != 2 or not all(hasattr(layer, name) for name in LAYER_TABLES):
            return original(self, layer, x_2d, topk_ids, topk_weights, original_dtype, original_shape)
        return batched_small_batch(ops, layer, x_2d, topk_ids, topk_weights, original_dtype, original_shape)

    return {MOE_SMALL_BATCH.key: tag("P16", _apply_small_batch, original)}


PATCH = Patch(
    id="P16",
    slug="exl3-moe-small-batch-per-token",
    title="EXL3 routed experts at 2 - 32 tokens: one multi-matrix GEMM per projection for every token's experts, "
    "not a loop over the tokens",
    upstream="not reported yet (patches/0016-exl3-moe-small-batch-per-token.patch)",
    fixed_in=None,
    retire_when="an aphrodite release serves 2 - 32 EXL3 MoE tokens without a per-token loop and is the oldest "
    "supported one",
    targets=(MOE_SMALL_BATCH,),
    probe=probe_moe_small_batch,
    build=build_moe_small_batch,
    checks_tag_after_apply=True,
    symptom="EXL3 MoE decode at 2 - 32 requests runs the experts one request at a time (1.7 ms more a request on "
    "the 35B-A3B)",
)
