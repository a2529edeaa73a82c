"""P4: a fused EXL3 projection with float16 activations, joined where Inductor cannot fold the split.

The failure itself needs a GPU (an illegal memory access in the compiled engine's first profiling
run, tests/gpu/test_server.py); its mechanism is Inductor's, and reproduces on the CPU in plain
torch (docs/upstream/repro/exl3_piecewise_strides.py, imported here). These tests show on the real
wheels that aphrodite's ``Exl3LinearMethod.apply`` hands Inductor that pattern (a bare ``cat``
of the shard outputs) for float16 input, that the overlay replaces exactly that case, and that its
join keeps the strides Inductor traced.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import exl3_linear_layer, needs_aphrodite, upstream_repro


def repro():
    return upstream_repro("exl3_piecewise_strides")


def fused_gdn_layer(exl3, method, device="meta"):
    """A GDN in_proj_qkvz as aphrodite loads it without LoRA: the checkpoint's in_proj_qkv as shard
    (0, 1, 2) and in_proj_z as shard 3, through aphrodite's own weight loader (meta tensors)."""

    def shard(fin, fout):
        return {
            "trellis": torch.zeros(fin // 16, fout // 16, 64, dtype=torch.int16),
            "suh": torch.zeros(fin, dtype=torch.float16),
            "svh": torch.zeros(fout, dtype=torch.float16),
        }

    return exl3_linear_layer(
        exl3,
        method,
        "language_model.model.layers.0.linear_attn.in_proj_qkvz",
        {(0, 1, 2): shard(256, 1024), 3: shard(256, 512)},
        device=device,
    )


@needs_aphrodite
def test_unpatched_apply_hands_inductor_a_bare_cat_in_float16(overlay):
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p4_fp16_cat as p4

    ops = p4.ops_of_fp16_fused_apply(exl3.Exl3LinearMethod.apply)
    assert ops.count("aphrodite.exl3_linear_one.default") == 2
    after = [op for op in ops[ops.index("aten.cat.default") :] if op not in p4.VIEW_OPS]
    assert after == ["aten.cat.default"], ops  # no cast between the cat and whatever splits it
    assert p4.probe_fp16_fused_cat({p4.APPLY.key: overlay.REGISTRY._resolve(p4.APPLY)})


@needs_aphrodite
def test_overlay_joins_float16_shards_behind_an_op_boundary(overlay):
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p4_fp16_cat as p4

    original = exl3.Exl3LinearMethod.apply
    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0, head_bits=None, tensor_storage={}))
    layer = fused_gdn_layer(exl3, method)
    x = torch.empty(2, 3, 256, dtype=torch.float16, device="meta")
    before = method.apply(layer, x)
    result = overlay.REGISTRY.apply(p4.PATCH)
    assert result.status.value == "APPLIED", result.reason
    ops = p4.ops_of_fp16_fused_apply(exl3.Exl3LinearMethod.apply)
    assert "hybrid_exl3_fixes.cat_last_dim.default" in ops and "aten.cat.default" not in ops
    after = method.apply(layer, x)
    assert (
        (after.shape, after.dtype, after.stride())
        == (before.shape, before.dtype, before.stride())
        == ((2, 3, 1536), torch.float16, (4608, 1536, 1))
    )
    assert overlay.undo_all() == ["P4"] and exl3.Exl3LinearMethod.apply is original


@needs_aphrodite
@pytest.mark.parametrize("case", ["bfloat16", "one shard", "mgemm"])
def test_every_other_call_reaches_the_original_apply(overlay, case):
    """bfloat16 activations (the cast already stops the rewrite), single-shard layers and the fused
    mgemm kernels go to aphrodite's own apply: the overlay changes only the float16 fused case."""
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p4_fp16_cat as p4

    seen = []
    original = exl3.Exl3LinearMethod.apply
    live = {p4.APPLY.key: overlay.REGISTRY._resolve(p4.APPLY)}
    live[p4.APPLY.key].raw = lambda *args: seen.append(args) or "original"  # what build() wraps
    patched = p4.build_fp16_fused_cat(live)[p4.APPLY.key]
    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0, head_bits=None, tensor_storage={}))
    layer = fused_gdn_layer(exl3, method)
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float16
    if case == "one shard":
        layer.exl3_shard_ids = [3]
    if case == "mgemm":
        layer.exl3_can_mgemm = True
    assert patched(method, layer, torch.empty(4, 256, dtype=dtype, device="meta")) == "original"
    assert len(seen) == 1 and exl3.Exl3LinearMethod.apply is original


def test_inductor_folds_split_of_cat_and_the_overlay_join_keeps_the_strides():
    """Plain torch, CPU: with float16 activations a split right after a cat of two custom-op outputs
    is rewritten to those outputs, so the piece before the splitting op returns z with its own row
    stride, and the piece after it (compiled for the cat's) computes garbage; bfloat16 (a cast in
    between) and the overlay's cat_last_dim keep the traced strides and match eager exactly."""
    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3.p4_fp16_cat import cat_last_dim

    r = repro()
    plain = r.run(64, fp16=True)
    if not plain["mismatches"]:
        pytest.skip(
            f"torch {torch.__version__} keeps the split outputs' strides: P4 is harmless but no longer needed "
            "for this torch (its probe looks at aphrodite's apply, which still hands Inductor the pattern)"
        )
    assert plain["mismatches"] == [
        "submod_2 input: got stride (384, 128, 1) expected (1024, 128, 1) (shape (64, 3, 128))"
    ]
    assert not math.isfinite(plain["max_abs_diff"]) or plain["max_abs_diff"] > 1e-2
    assert r.run(64, fp16=True, config_patches={"pattern_matcher": False})["mismatches"] == []  # the rewrite does it
    for result in (r.run(64, fp16=False), r.run(64, fp16=True, join=cat_last_dim())):
        assert result["mismatches"] == [] and result["max_abs_diff"] == 0.0, result
