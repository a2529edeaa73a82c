"""P4: a fused EXL3 projection in float16, compiled: Inductor folds the GDN split into the concat.

Target: ``aphrodite/model_executor/layers/quantization/exl3.py``.

Why:     ``Exl3LinearMethod.apply`` runs one kernel per checkpoint tensor of a fused projection and
         joins the float16 outputs with ``torch.cat``; it casts back only when the activations are
         not float16. With float16 activations (a float16 config, or ``--dtype float16``), the
         merged GDN ``in_proj_qkvz`` (built whenever LoRA is off: ``models/qwen3_5.py:142``) is a
         bare ``cat`` that ``gdn_linear_attn.py:540`` splits straight back into its two inputs.
         Inductor's ``cat_splitwithsizes_replace`` (torch/_inductor/fx_passes/post_grad.py)
         rewrites ``split(cat([a, b]))`` to ``[a, b]``, so the graph piece before
         ``gdn_attention_core`` returns ``z`` with its own row stride instead of the traced one
         (the cat's), and the piece after it, compiled for the traced strides, reads past the end:
         ``CUDA error: an illegal memory access`` in the first profiling run (H200, 0.21.0) and
         NaN on the CPU (docs/upstream/repro/exl3_piecewise_strides.py reproduces it in plain torch).
         bfloat16 activations are safe: the fp16 -> bf16 cast between cat and split stops the
         rewrite. docs/upstream/exl3-compiled-illegal-address.md.
How:     For float16 input to a layer with several shards and no fused mgemm kernel, join the
         outputs with ``hybrid_exl3_fixes::cat_last_dim``, a custom op (torch.cat inside) that
         Inductor cannot see through; every other call goes to the original ``apply`` unchanged.
         The probe runs the live ``apply`` on meta tensors (~2 ms) and looks at the last op that
         produced its output: a bare ``aten.cat`` is the bug.
Upstream: not reported before this project; report and diff in
         docs/upstream/exl3-compiled-illegal-address.md and patches/0004-exl3-compiled-illegal-address.patch.
         Present in every release from 0.20.0 to 0.24.1 (the same ``apply``; CPU suite).
Retire when: aphrodite joins EXL3 shard outputs where Inductor cannot fold them (the probe then
         reports UPSTREAM_FIXED), or PyTorch's rewrite keeps the split outputs' strides.
"""

from __future__ import annotations

import types
from typing import Any

from hybrid_exl3_fixes.registry import (
    Drift,
    Live,
    Patch,
    Target,
    tag,
)
from hybrid_exl3_fixes.shared import MODULE

APPLY = Target(MODULE, "Exl3LinearMethod.apply", params=("self", "layer", "x", "bias"))
VIEW_OPS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.alias.default")
# the custom op, registered with torch on first use; it outlives an undo (torch cannot unregister an op), and
# only the patched apply calls it, so after undo it is inert
_CAT_OP = None


def cat_last_dim():
    """``hybrid_exl3_fixes::cat_last_dim(tensors) -> Tensor``: torch.cat(tensors, -1) behind a custom-op
    boundary, so Inductor's pattern passes cannot fold a following split into it (P4). Registered once
    per process; any device (the probe and the CPU tests run it on meta and CPU tensors)."""
    global _CAT_OP
    if _CAT_OP is not None:
        return _CAT_OP
    import torch

    def cat(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors, dim=-1)

    op = torch.library.custom_op(
        "hybrid_exl3_fixes::cat_last_dim", cat, mutates_args=(), schema="(Tensor[] tensors) -> Tensor"
    )

    @op.register_fake
    def _(tensors):
        return tensors[0].new_empty((*tensors[0].shape[:-1], sum(t.shape[-1] for t in tensors)))

    _CAT_OP = op
    return op


def _probe_layer(torch):
    """A two-shard EXL3 linear on the meta device (a GDN in_proj_qkvz as aphrodite builds it: the
    checkpoint's in_proj_qkv as one (0, 1, 2) shard and in_proj_z as shard 3), no mgemm."""

    def store(make):
        return types.SimpleNamespace(exl3_tensors={shard: make() for shard in ((0, 1, 2), 3)})

    return types.SimpleNamespace(
        prefix="language_model.model.layers.0.linear_attn.in_proj_qkvz",
        exl3_can_mgemm=False,
        exl3_shard_ids=[(0, 1, 2), 3],
        mcg=types.SimpleNamespace(exl3_tensors={}),
        mul1=types.SimpleNamespace(exl3_tensors={}),
        trellis=store(lambda: torch.empty(8, 8, 64, dtype=torch.int16, device="meta")),
        suh=store(lambda: torch.empty(128, dtype=torch.float16, device="meta")),
        svh=store(lambda: torch.empty(128, dtype=torch.float16, device="meta")),
    )


def ops_of_fp16_fused_apply(apply) -> list[str]:
    """The ops the live ``Exl3LinearMethod.apply`` dispatches for float16 input to a two-shard layer."""
    import aphrodite.model_executor.layers.quantization.exl3 as exl3
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0, head_bits=None, tensor_storage={}))
    layer, x = _probe_layer(torch), torch.empty(4, 128, dtype=torch.float16, device="meta")
    with Record() as record:
        apply(method, layer, x, None)
    return record.ops


def probe_fp16_fused_cat(live: dict[str, Live]) -> bool:
    """True = buggy: after the EXL3 kernels, the op that produced apply's output (views aside) is a
    bare ``aten.cat``, the form Inductor's cat/split rewrite matches."""
    ops = ops_of_fp16_fused_apply(live[APPLY.key].function)
    kernels = [i for i, op in enumerate(ops) if "exl3" in op and not op.startswith("aten.")]
    if len(kernels) < 2:
        raise Drift(f"Exl3LinearMethod.apply ran {len(kernels)} EXL3 kernel(s) for a two-shard layer: {ops}")
    produced = [op for op in ops[kernels[-1] + 1 :] if op not in VIEW_OPS]
    return produced[-1:] == ["aten.cat.default"]


def build_fp16_fused_cat(live: dict[str, Live]) -> dict[str, Any]:
    original = live[APPLY.key].function
    join = cat_last_dim()
    import torch

    def apply(self, layer, x, bias=None):
        shards = layer.exl3_shard_ids
        if x.dtype != torch.float16 or getattr(layer, "exl3_can_mgemm", False) or len(shards) < 2:
            return original(self, layer, x, bias)
        x_2d = x.reshape(-1, x.shape[-1]).contiguous()
        output = join([self._apply_one(layer, x_2d, shard_id) for shard_id in shards])
        if bias is not None:
            output = output + bias
        return output.reshape(*x.shape[:-1], output.shape[-1])

    return {APPLY.key: tag("P4", apply, original)}


PATCH = Patch(
    id="P4",
    slug="exl3-compiled-illegal-address",
    title="fused EXL3 projection in float16: join the shard outputs where Inductor cannot fold the GDN split",
    upstream="docs/upstream/exl3-compiled-illegal-address.md (not reported upstream before this project)",
    fixed_in=None,
    retire_when="aphrodite joins EXL3 shard outputs behind an op boundary, or PyTorch's cat/split rewrite keeps "
    "strides",
    targets=(APPLY,),
    probe=probe_fp16_fused_cat,
    build=build_fp16_fused_cat,
    symptom="compiled mode with float16 activations: `illegal memory access` in the first profiling run",
)
