# SPDX-License-Identifier: Apache-2.0
"""The small-batch EXL3 GEMM honours each layer's codebook (drop-in for aphrodite's
tests/kernels/quantization/).

exl3_gemm cached its kernel per (size_k, size_n, cc, K, c_fp32) without the codebook
(select_exl3_gemm_mgemm_kernel_new, csrc/quantization/exl3/exllamav3_ext/quant/exl3_kernel_map.cu),
so in one process a layer of the same shape and bitrate as an earlier one ran the earlier
layer's codebook kernel at <= 32 rows. The reference is the > 32-row path (exl3_reconstruct +
hgemm), which decodes every codebook right.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="EXL3 kernels need CUDA")

CODEBOOKS = {"mcg": (True, False), "mul1": (False, True), "3inst": (False, False)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("rows", [1, 4, 32])
def test_small_batch_gemm_decodes_each_codebook(rows):
    import aphrodite.model_executor.layers.quantization.exl3  # noqa: F401 - registers the op

    gen = torch.Generator().manual_seed(rows)
    k, n, K = 1024, 2048 + 128 * rows, 3  # a shape of its own per case: each starts the cache afresh
    trellis = torch.randint(-(1 << 15), 1 << 15, (k // 16, n // 16, 16 * K), generator=gen, dtype=torch.int16).cuda()
    suh = ((torch.randint(0, 2, (k,), generator=gen) * 2 - 1) * 0.1).half().cuda()
    svh = ((torch.randint(0, 2, (n,), generator=gen) * 2 - 1) * 0.1).half().cuda()
    x = torch.randn(33, k, generator=gen).half().cuda()
    linear = torch.ops.aphrodite.exl3_linear_one
    errors = {}
    for name, (mcg, mul1) in CODEBOOKS.items():  # two layers of one shape and K, other codebooks
        small = linear(x[:rows].contiguous(), trellis, suh, svh, mcg, mul1)
        reference = linear(x, trellis, suh, svh, mcg, mul1)[:rows]
        errors[name] = _rel(small, reference)
    assert all(err < 1e-2 for err in errors.values()), errors
