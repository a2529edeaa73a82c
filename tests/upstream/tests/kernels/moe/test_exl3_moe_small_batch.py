# SPDX-License-Identifier: Apache-2.0
"""EXL3 routed experts at 2 - 32 tokens: the same answer as one token at a time, in a few GEMM launches (drop-in for
aphrodite's tests/kernels/moe/).

Exl3MoEMethod.apply sends 2 to exl3_small_batch_threshold tokens (min(experts // top_k, 32)) to _apply_small_batch.
Its answer must be each token's own one-token answer, eager and in a CUDA graph replayed on new routing; and it must
not launch the experts' GEMM once per token (the loop over tokens makes the decode step of N requests N times the
one-token MoE). Here 256 experts, 8 active (threshold 32, as Qwen3.6-35B-A3B), at the tiny width.
"""

import pytest
import torch
from exl3_moe_layer import HIDDEN, exl3_moe_apply

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="EXL3 MoE kernels and CUDA graphs need CUDA")

EXPERTS, TOP_K = 256, 8


@pytest.fixture(scope="module")
def apply():
    return exl3_moe_apply(experts=EXPERTS, top_k=TOP_K)


def routed(tokens, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(tokens, EXPERTS, generator=g, device="cuda").argsort(-1)[:, :TOP_K].contiguous()
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g, device="cuda"), -1)
    return x, weights, ids


def token_by_token(apply, x, weights, ids):
    return torch.cat([apply(x[i : i + 1], weights[i : i + 1], ids[i : i + 1]) for i in range(x.shape[0])]).float()


def relative(y, reference):
    return float((y.float() - reference).norm() / reference.norm())


@pytest.mark.parametrize("tokens", [2, 3, 8, 17, 32])
def test_small_batch_is_each_tokens_own_answer_eager_and_in_a_graph(apply, tokens):
    assert apply.layer.exl3_small_batch_threshold == 32
    x, weights, ids = routed(tokens, tokens)
    assert relative(apply(x, weights, ids), token_by_token(apply, x, weights, ids)) < 1e-2
    statics = [t.clone() for t in (x, weights, ids)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        apply(*statics)  # warm-up outside the graph, as aphrodite captures
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = apply(*statics)
    fresh = routed(tokens, 100 + tokens)  # new rows and new routing into the captured inputs
    for static, new in zip(statics, fresh):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert relative(captured, token_by_token(apply, *fresh)) < 1e-2


def test_small_batch_does_not_launch_the_experts_gemm_per_token(apply):
    x, weights, ids = routed(8, 0)
    apply(x, weights, ids)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        apply(x, weights, ids)
        torch.cuda.synchronize()
    launches = sum(e.count for e in prof.key_averages() if "mgemm" in e.key)
    # one token takes 2 (gate and up fused, then down) or 3; a loop over 8 tokens 16 or 24
    assert 0 < launches <= 3, f"8 tokens launched the experts' GEMM {launches} times"
