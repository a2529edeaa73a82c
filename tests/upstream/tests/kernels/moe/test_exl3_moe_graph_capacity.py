# SPDX-License-Identifier: Apache-2.0
"""EXL3 routed experts give the same answer inside a CUDA graph as outside it (drop-in for aphrodite's
tests/kernels/moe/).

ops.exl3_moe skips every expert that received more tokens than its per-expert capacity
(``if (token_count > max_tokens_per_expert) continue;``, exl3_moe_kernel.cuh; 128 tokens); outside a
graph Exl3MoEMethod.apply computes those experts afterwards, but while a graph is captured it returns
straight after the kernel, so a replay leaves them out. Here every token picks experts 0 and 1, 256
tokens: expert 0 gets 256 > 128.
"""

import pytest
import torch
from exl3_moe_layer import HIDDEN, TOP_K, exl3_moe_apply

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="EXL3 MoE kernels and CUDA graphs need CUDA")


@pytest.mark.parametrize("tokens", [256, 200])
def test_exl3_moe_in_a_cuda_graph_keeps_experts_over_the_kernel_capacity(tokens):
    apply = exl3_moe_apply()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1]], device="cuda").expand(tokens, TOP_K).contiguous()  # expert 0: every token
    weights = torch.full((tokens, TOP_K), 0.5, device="cuda")
    eager = apply(x, weights, ids).float()
    assert torch.isfinite(eager).all() and eager.abs().max() > 0

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        apply(x, weights, ids)  # warm-up outside the graph, as aphrodite captures
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = apply(x, weights, ids)
    graph.replay()
    torch.cuda.synchronize()
    error = (captured.float() - eager).norm() / eager.norm()
    assert error < 2e-2, f"{tokens} tokens: the graph's output is {error:.3f} away (relative) from the eager one"
