# SPDX-License-Identifier: Apache-2.0
"""EXL3 routed experts take the padding rows' expert id -1 (drop-in for aphrodite's tests/kernels/moe/).

Since 0.23.0 the fused top-k routers give the rows a batch is padded with (CUDA-graph sizes, the profiling run)
expert id -1 (APHRODITE_MOE_SKIP_PADDING, on by default). Exl3MoEMethod.apply must skip them: the batched path's
expert_count.scatter_add_ asserts on -1 (every EXL3 MoE model stopped at start-up on 0.24.1), and the per-token paths
index the experts' pointer tables with the ids. The real rows' outputs must be those of the same batch whose
padding rows pick real experts (rows are independent).
"""

import pytest
import torch
from exl3_moe_layer import EXPERTS, HIDDEN, TOP_K, exl3_moe_apply, routers_mark_padding

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="EXL3 MoE kernels need CUDA"),
    pytest.mark.skipif(
        not routers_mark_padding(), reason="this release's routers never give padding rows expert id -1 (0.23.0+ do)"
    ),
]


@pytest.mark.parametrize("rows, real", [(1, 0), (2, 1), (8, 5), (40, 33), (300, 290)])
def test_exl3_moe_skips_the_padding_id(rows, real):
    """1 row: the one-token path; 2: the small-batch path (threshold EXPERTS // TOP_K); more: the batched one."""
    apply = exl3_moe_apply()
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(rows, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g, device="cuda")[:TOP_K] for _ in range(rows)])
    weights = torch.rand(rows, TOP_K, generator=g, device="cuda")
    reference = apply(x, weights, ids).float()  # every row picks real experts
    padded = ids.clone()
    padded[real:] = -1
    out = apply(x, weights, padded).float()
    torch.cuda.synchronize()
    if real:
        error = (out[:real] - reference[:real]).norm() / reference[:real].norm()
        assert error < 2e-2, f"{rows} rows, {rows - real} padding: the real rows are {error:.3f} away (relative)"
