"""P13's EXL3 half on the GPU (0.21+): the decomposed expert MLP that ``Exl3LoRAExperts`` runs when a batch carries
LoRA -- gate and up per (token, expert) assignment, SiLU-and-mul, down with the routed weights summed per token --
answers like the dense weights of the same EXL3 tensors and like aphrodite's fused ``Exl3MoEMethod.apply``, on the
token loop (eagerly and replayed from a CUDA graph) and on the per-expert path, at the tiny MoE's shape and at the
35B-A3B's width (fewer experts). A real EXL3 MoE layer: aphrodite's own ``_setup_fused_moe_kernel`` over random
EXL3 tensors (``codec.random_exl3_linear``). The LoRA deltas themselves are aphrodite's kernels, checked end to end
against HF + PEFT by the MoE server suite's ``*-lora-experts3d-p13`` cells."""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from hybrid_exl3_fixes.exl3 import codec, moe_lora

EXL3 = "aphrodite.model_executor.layers.quantization.exl3"
TOLERANCE = 2e-2  # relative Frobenius error against float32 dense weights; the EXL3 kernels compute in float16
SHAPES = {  # name: (hidden, intermediate, experts, top_k)
    "tiny": (256, 256, 4, 2),
    "35b-a3b-width": (2048, 512, 16, 8),
}
TOKENS = (1, 2, 3, 8, 40, 100)


class Holder:
    """An Exl3MoEParameter as the checkpoint loader leaves it: ``exl3_tensors[(expert, shard)]``."""

    def __init__(self):
        self.exl3_tensors = {}


def moe_layer(hidden: int, inter: int, experts: int, top_k: int, bits: int = 4, codebook: str = "mcg"):
    """A loaded EXL3 MoE layer (TP 1) and each expert's dense (gate, up, down), float32 on the GPU."""
    exl3 = importlib.import_module(EXL3)
    from aphrodite.model_executor.layers.fused_moe.activation import MoEActivation

    layer = types.SimpleNamespace(
        local_num_experts=experts, top_k=top_k, hidden_size=hidden, exl3_intermediate_size_per_partition=inter,
        activation=MoEActivation.SILU, expert_map=None, apply_router_weight_on_input=False,
    )  # fmt: skip
    for prefix in ("w13", "w2"):
        for name in ("trellis", "suh", "svh", "mcg", "mul1"):
            setattr(layer, f"{prefix}_{name}", Holder())
    gen, dense = torch.Generator().manual_seed(35), []
    for e in range(experts):
        weights = []
        for prefix, shard, fin, fout in (("w13", "w1", hidden, inter), ("w13", "w3", hidden, inter),
                                         ("w2", "w2", inter, hidden)):  # fmt: skip
            tensors = codec.random_exl3_linear(fin, fout, bits, codebook, gen, device="cuda")
            for name, tensor in tensors.items():
                getattr(layer, f"{prefix}_{name}").exl3_tensors[(e, shard)] = tensor.cuda()
            weights.append(codec.dense_weight(tensors, bits, device="cuda"))
        dense.append(weights)
    exl3.Exl3MoEMethod._setup_fused_moe_kernel(
        layer, torch.device("cuda", torch.cuda.current_device())
    )  # 0.24 reads its index
    return layer, dense


def routed(m: int, hidden: int, experts: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, hidden, generator=gen) * 2).to(torch.float16).cuda()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(m)]).cuda()
    weights = torch.softmax(torch.randn(m, top_k, generator=gen), -1).to(torch.float16).cuda()
    return x, ids, weights


def dense_reference(dense, x, ids, weights):
    out = torch.zeros(x.shape[0], x.shape[1], device="cuda")
    xf = x.float()
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate, up, down = dense[e]
            act = torch.nn.functional.silu(xf[t] @ gate) * (xf[t] @ up)
            out[t] += weights[t, j].float() * (act @ down)
    return out


def decomposed(layer, x, ids, weights, token_loop: bool, out=None, cache1=None, cache2=None):
    """Exl3LoRAExperts.apply's base computation (without the LoRA deltas), in its buffers' dtype (bfloat16)."""
    from aphrodite import _custom_ops as ops

    exl3 = importlib.import_module(EXL3)
    m, k = ids.shape
    inter = layer.exl3_intermediate_size_per_partition
    cache1 = cache1 if cache1 is not None else torch.empty(m, k, 2 * inter, dtype=torch.bfloat16, device="cuda")
    cache2 = cache2 if cache2 is not None else torch.empty(m * k, inter, dtype=torch.bfloat16, device="cuda")
    out = out if out is not None else torch.zeros(m, x.shape[1], dtype=torch.float32, device="cuda")
    if token_loop:
        moe_lora.gate_up_per_token(layer, ops, x, ids, cache1)
    else:
        groups = moe_lora.assignments_by_expert(ids)
        moe_lora.gate_up_per_expert(exl3.Exl3MoEMethod, layer, groups, k, x, cache1)
    flat = cache1.view(-1, 2 * inter)
    cache2.copy_(torch.nn.functional.silu(flat[:, :inter].float()) * flat[:, inter:].float())
    if token_loop:
        moe_lora.down_per_token(layer, ops, cache2, ids, weights, out)
    else:
        moe_lora.down_per_expert(exl3.Exl3MoEMethod, layer, groups, k, cache2, weights, out)
    return out


def error(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module", params=list(SHAPES))
def layer(request):
    if moe_lora.lora_experts_mixin() is None:
        pytest.skip("this aphrodite has no LoRAExpertsMixin: P13 does not apply (0.20 keeps P5's refusal)")
    hidden, inter, experts, top_k = SHAPES[request.param]
    return request.param, *moe_layer(hidden, inter, experts, top_k)


@pytest.mark.parametrize("path", ["token-loop", "per-expert"])
def test_the_decomposed_experts_answer_like_the_dense_weights_and_the_fused_kernel(layer, path, record):
    name, moe, dense = layer
    exl3 = importlib.import_module(EXL3)
    method = exl3.Exl3MoEMethod.__new__(exl3.Exl3MoEMethod)  # apply reads only the layer
    worst_dense = worst_fused = 0.0
    for m in TOKENS:
        x, ids, weights = routed(m, moe.hidden_size, moe.local_num_experts, moe.top_k, seed=m)
        ref = dense_reference(dense, x, ids, weights)
        fused = moe_lora.fused_apply(method, moe, x, weights.float(), ids.to(torch.int32))
        fused = fused.float().clone()
        got = decomposed(moe, x, ids, weights, token_loop=path == "token-loop")
        worst_dense = max(worst_dense, error(got, ref))
        worst_fused = max(worst_fused, error(got, fused))
        assert error(fused, ref) < TOLERANCE, (m, error(fused, ref))  # the reference itself is right
    record(f"P13 decomposed experts, {name}, {path}", against_dense=worst_dense, against_fused=worst_fused)
    assert worst_dense < TOLERANCE and worst_fused < TOLERANCE, (worst_dense, worst_fused)


def test_the_token_loop_replays_from_a_cuda_graph(layer, record):
    """The token loop holds only fixed-shape launches on fixed buffers: captured once, it answers new inputs."""
    name, moe, dense = layer
    m = 4
    x, ids, weights = routed(m, moe.hidden_size, moe.local_num_experts, moe.top_k, seed=100)
    inter = moe.exl3_intermediate_size_per_partition
    cache1 = torch.empty(m, moe.top_k, 2 * inter, dtype=torch.bfloat16, device="cuda")
    cache2 = torch.empty(m * moe.top_k, inter, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(m, moe.hidden_size, dtype=torch.float32, device="cuda")
    decomposed(moe, x, ids, weights, True, out.zero_(), cache1, cache2)  # warm-up, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.zero_()
        decomposed(moe, x, ids, weights, True, out, cache1, cache2)
    x2, ids2, weights2 = routed(m, moe.hidden_size, moe.local_num_experts, moe.top_k, seed=101)
    x.copy_(x2), ids.copy_(ids2), weights.copy_(weights2)
    graph.replay()
    torch.cuda.synchronize()
    err = error(out, dense_reference(dense, x2, ids2, weights2))
    record(f"P13 token loop from a CUDA graph, {name}", against_dense=err)
    assert err < TOLERANCE, err
