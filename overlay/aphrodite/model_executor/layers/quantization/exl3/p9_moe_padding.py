"""P9: EXL3 routed experts and padding rows: the expert id -1 that 0.23+ give them is out of range.

Target: ``aphrodite/model_executor/layers/quantization/exl3.py``.

Why:     0.23.0 turned ``APHRODITE_MOE_SKIP_PADDING`` on by default (envs.py: ``"1"``; 0.22.0: ``"0"``) and
         moved it into the top-k kernel of every fused router (router/fused_topk_router.py ``_get_padding_mask``
         passes ``is_padding`` to ``ops.topk_softmax``): the rows the V2 model runner adds to reach a
         CUDA-graph size, and those of its profiling run, get expert id -1 (vLLM #48979; 0.22.0's own
         modular_kernel.py comment: it "requires the experts kernel to treat topk_id == -1 as a skip
         sentinel, which not all MoE backends support yet"). ``Exl3MoEMethod.apply`` does not: its large-batch
         path counts tokens per expert with ``expert_count.scatter_add_(0, expert_sorted, ...)``, and its
         one-token and small-batch paths pass the ids to ``exl3_mgemm`` as indices into the experts' pointer
         tables. So every EXL3 MoE hybrid stops in the profiling run, ``ScatterGatherKernel.cu:203: Assertion
         `idx_dim >= 0 && idx_dim < index_size``` then ``torch.AcceleratorError: CUDA error: device-side assert
         triggered`` at ``expert_count.tolist()`` (docs/upstream/exl3-moe-padding-expert-ids.md). 0.23.0 - 0.24.1.
How:     before the original ``apply``, give padding rows an id its path takes: on the large-batch path
         ``local_num_experts``, the spare last slot of ``expert_count`` that the fused kernel and the fallback never
         read (exllamav3 1.6.5 exl3_moe.cu: "last item is ignored"; its block_sparse_mlp.py sends experts outside a
         shard there): ``topk_ids.remainder(E + 1)``, -1 becomes E, real ids stay, one kernel; on the one-token and
         small-batch paths expert 0 (``clamp(min=0)``): a padding row's output is thrown away, whatever it is. Placed
         under P7 (applied first), so each chunk P7 captures is sanitised for the path its own size takes.
Probe:   NOT_APPLICABLE where no router marks padding rows in the top-k ids EXL3 receives (0.20 - 0.22:
         0.22.0 does it in the modular kernel only, which EXL3 MoE does not use); buggy when the live
         ``apply``'s source never compares ``topk_ids`` with 0 nor clamps it.
Upstream: not reported yet; the upstream-ready diff is patches/0009-exl3-moe-padding-expert-ids.patch.
         (P8, numbered before it, is the small-row kernel choice of docs/upstream/exl3-small-batch-kernel-choice.md.)
Workaround without the overlay: ``APHRODITE_MOE_SKIP_PADDING=0``.
Retire when: an aphrodite release treats expert id -1 as a skip in ``Exl3MoEMethod.apply`` and is the oldest
         supported one.
"""

from __future__ import annotations

from typing import Any

from hybrid_exl3_fixes.registry import (
    MARKER,
    Live,
    NotApplicable,
    Patch,
    tag,
    wrapper_chain,
)
from hybrid_exl3_fixes.shared import MOE_APPLY, marks_padding_rows, source_tree


def handles_negative_ids(function) -> bool:
    """True when ``apply``'s source compares ``topk_ids`` itself with 0 or -1 (``topk_ids < 0``) or clamps it
    (``topk_ids.clamp(...)``, ``.remainder(...)``): a fix upstream. ``topk_ids.shape[-1] == 1`` is not one."""
    import ast

    tree = source_tree(function, "Exl3MoEMethod.apply")

    def is_ids(node) -> bool:
        return isinstance(node, ast.Name) and node.id == "topk_ids"

    def zero_or_minus_one(node) -> bool:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return isinstance(node.operand, ast.Constant) and node.operand.value == 1
        return isinstance(node, ast.Constant) and node.value == 0

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and is_ids(node.left) and any(zero_or_minus_one(c) for c in node.comparators):
            return True
        func = getattr(node, "func", None) if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Attribute) and is_ids(func.value) and func.attr in CLAMPS:
            return True
    return False


CLAMPS = ("clamp", "clamp_", "clamp_min", "clamp_min_", "remainder", "masked_fill", "where")


def probe_moe_padding_ids(live: dict[str, Live]) -> bool:
    """True = buggy: the routers give padding rows expert id -1 and the live ``apply`` passes it on."""
    function = live[MOE_APPLY.key].function
    if any(getattr(f, MARKER, None) == "P9" for f in wrapper_chain(function)):
        return False
    if not marks_padding_rows():
        raise NotApplicable("this release's routers never give EXL3 experts the padding id -1 (0.23+ do)")
    return not handles_negative_ids(function)


def padding_safe_ids(layer: Any, rows: int, topk_ids):
    """``topk_ids`` with every padding id (-1) replaced by one the path of a ``rows``-row batch takes."""
    if rows == 1 or rows <= getattr(layer, "exl3_small_batch_threshold", 0):
        return topk_ids.clamp(min=0)  # pointer-table indices: any real expert (the row is thrown away)
    return topk_ids.remainder(layer.local_num_experts + 1)  # the slot the kernel and the fallback skip


def build_moe_padding_ids(live: dict[str, Live]) -> dict[str, Any]:
    original = live[MOE_APPLY.key].function

    def apply(self, layer, x, topk_weights, topk_ids, *rest, **kwargs):
        rows = x.numel() // x.shape[-1]
        return original(self, layer, x, topk_weights, padding_safe_ids(layer, rows, topk_ids), *rest, **kwargs)

    return {MOE_APPLY.key: tag("P9", apply, original)}


PATCH = Patch(
    id="P9",
    slug="exl3-moe-padding-expert-ids",
    title="EXL3 routed experts: padding rows' expert id -1 (APHRODITE_MOE_SKIP_PADDING, 0.23+) mapped to one "
    "the kernel takes",
    upstream="not reported yet (patches/0009-exl3-moe-padding-expert-ids.patch)",
    fixed_in=None,
    retire_when="an aphrodite release treats expert id -1 as a skip in Exl3MoEMethod.apply and is the oldest "
    "supported one",
    targets=(MOE_APPLY,),
    probe=probe_moe_padding_ids,
    build=build_moe_padding_ids,
    checks_tag_after_apply=True,
    symptom="EXL3 MoE stops at start-up with a device-side assert (padding rows carry expert id -1)",
)
