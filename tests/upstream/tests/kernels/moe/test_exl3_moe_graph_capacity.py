# SPDX-License-Identifier: Apache-2.0
"""EXL3 routed experts give the same answer inside a CUDA graph as outside it (drop-in for aphrodite's
tests/kernels/moe/).

ops.exl3_moe skips every expert that received more tokens than its per-expert capacity
(``if (token_count > max_tokens_per_expert) continue;``, exl3_moe_kernel.cuh; 128 tokens); outside a
graph Exl3MoEMethod.apply computes those experts afterwards, but while a graph is captured it returns
straight after the kernel, so a replay leaves them out. Here every token picks experts 0 and 1, 256
tokens: expert 0 gets 256 > 128.
"""

import inspect
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="EXL3 MoE kernels and CUDA graphs need CUDA")

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, BITS = 4, 2, 256, 256, 4  # make-tiny's tiny-moe experts


def _trellis(rows, cols, generator):
    # any bit pattern is a valid trellis: (in / 16, out / 16, 16 * bits) int16
    shape = (rows // 16, cols // 16, 16 * BITS)
    return torch.randint(-(2**15), 2**15, shape, generator=generator, dtype=torch.int32).to(torch.int16)


def _signs(n, scale, generator):
    return (torch.randint(0, 2, (n,), generator=generator) * 2 - 1).to(torch.float16) * scale


def _layer():
    from aphrodite.model_executor.layers.fused_moe.activation import MoEActivation
    from aphrodite.model_executor.layers.quantization.exl3 import Exl3MoEMethod

    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    for prefix in ("w13", "w2"):
        for attr in ("suh", "svh", "trellis", "mcg", "mul1"):
            setattr(layer, f"{prefix}_{attr}", SimpleNamespace(exl3_tensors={}))
    for e in range(EXPERTS):
        for shard in ("w1", "w3"):
            layer.w13_trellis.exl3_tensors[(e, shard)] = _trellis(HIDDEN, INTERMEDIATE, g).to(device)
            layer.w13_suh.exl3_tensors[(e, shard)] = _signs(HIDDEN, 1.0, g).to(device)
            layer.w13_svh.exl3_tensors[(e, shard)] = _signs(INTERMEDIATE, 0.05, g).to(device)
            layer.w13_mcg.exl3_tensors[(e, shard)] = torch.zeros(1, device=device)  # mcg: the MoE kernel's codebook
        layer.w2_trellis.exl3_tensors[(e, "w2")] = _trellis(INTERMEDIATE, HIDDEN, g).to(device)
        layer.w2_suh.exl3_tensors[(e, "w2")] = _signs(INTERMEDIATE, 1.0, g).to(device)
        layer.w2_svh.exl3_tensors[(e, "w2")] = _signs(HIDDEN, 0.05, g).to(device)
        layer.w2_mcg.exl3_tensors[(e, "w2")] = torch.zeros(1, device=device)
    layer.local_num_experts, layer.top_k, layer.hidden_size = EXPERTS, TOP_K, HIDDEN
    layer.exl3_intermediate_size_per_partition = INTERMEDIATE
    layer.activation, layer.expert_map, layer.apply_router_weight_on_input = MoEActivation.SILU, None, False
    Exl3MoEMethod._setup_fused_moe_kernel(layer, device)
    method = object.__new__(Exl3MoEMethod)
    extra = (None,) * (len(inspect.signature(Exl3MoEMethod.apply).parameters) - 5)  # shared-expert arguments
    return lambda x, w, ids: method.apply(layer, x, w, ids, *extra)


@pytest.mark.parametrize("tokens", [256, 200])
def test_exl3_moe_in_a_cuda_graph_keeps_experts_over_the_kernel_capacity(tokens):
    apply = _layer()
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
