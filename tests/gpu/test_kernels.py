"""aphrodite 0.21.0's EXL3 kernels against the reference codec (GPU).

Each codebook gets a layer shape of its own: the small-batch GEMM keeps the first codebook it
ran for a shape (docs/upstream/exl3-gemm-codebook-cache.md), and this suite must not depend on test order."""

from __future__ import annotations

import pytest
import torch

from hybrid_exl3_fixes.checkpoint import codec

SHAPES = {"mcg": (256, 512), "mul1": (512, 256), "3inst": (384, 256)}


@pytest.mark.parametrize("codebook", codec.CODEBOOKS)
@pytest.mark.parametrize("K", range(1, 9))
def test_reconstruct_is_bit_exact(codebook, K, record):
    import aphrodite._custom_ops as ops

    tensors = codec.random_exl3_linear(256, 256, K, codebook, torch.Generator().manual_seed(K))
    trellis = tensors["trellis"].cuda()
    out = torch.empty(256, 256, dtype=torch.float16, device="cuda")
    ops.exl3_reconstruct(out, trellis, K, codebook == "mcg", codebook == "mul1")
    expected = codec.decode_tiles(tensors["trellis"], K, codebook)
    mismatches = int((out.cpu().view(torch.int16) != expected.view(torch.int16)).sum())
    record("exl3_reconstruct bit-exact", **{f"{codebook} K={K}": f"{mismatches} mismatches"})
    assert mismatches == 0


@pytest.mark.parametrize("codebook", codec.CODEBOOKS)
def test_linear_against_dense(codebook, record):
    import aphrodite.model_executor.layers.quantization.exl3  # noqa: F401 - registers the op

    fin, fout = SHAPES[codebook]
    gen = torch.Generator().manual_seed(11)
    worst = {}
    for K in (2, 3, 4, 6, 8):
        tensors = codec.random_exl3_linear(fin, fout, K, codebook, gen)
        dense = codec.dense_weight(tensors, K).cuda()
        for rows in (1, 2, 4, 8, 16, 32, 33, 48, 64):
            x = torch.randn(rows, fin, generator=gen).to(torch.float16).cuda()
            y = torch.ops.aphrodite.exl3_linear_one(
                x,
                tensors["trellis"].cuda(),
                tensors["suh"].cuda(),
                tensors["svh"].cuda(),
                codebook == "mcg",
                codebook == "mul1",
            )
            ref = x.float() @ dense
            rel = float((y.float() - ref).norm() / ref.norm())
            worst[f"K={K} rows={rows}"] = rel
    record(
        f"exl3_linear_one vs x @ W_dense ({codebook}, {fin}x{fout})",
        max_rel_error=max(worst.values()),
        worst_case=max(worst, key=worst.get),
    )
    assert max(worst.values()) < 5e-3, worst
