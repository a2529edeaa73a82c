"""P13's EXL3 half on the GPU (0.21+): the decomposed expert MLP that ``Exl3LoRAExperts`` runs when a batch carries
LoRA -- gate and up per (token, expert) assignment, SiLU-and-mul, down with the routed weights summed per token --
answers like the dense weights of the same EXL3 tensors and like aphrodite's fused ``Exl3MoEMethod.apply``, on the
token loop (eagerly and replayed from a CUDA graph) and on the per-expert path, at the tiny MoE's shape and at the
35B-A3B's width (fewer experts). A real EXL3 MoE layer: aphrodite's own ``_setup_fused_moe_kernel`` over random
EXL3 tensors (``codec.random_exl3_linear``). Then the whole ``apply`` with the LoRA deltas, tokens of several
adapters mixed, against aphrodite's own ``TritonExperts`` on the same weights with the same ``MoELoRAContext``:
where the MoE server suite's ``*-lora-experts3d-p13`` cells (against HF + PEFT) find a difference, this says
whether it lies in P13's experts."""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p13_moe_expert_lora as moe_lora
from hybrid_exl3_fixes.checkpoint import codec

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
    rows = {}  # tokens: (decomposed against dense, decomposed against fused, fused against dense), all recorded
    for m in TOKENS:
        x, ids, weights = routed(m, moe.hidden_size, moe.local_num_experts, moe.top_k, seed=m)
        ref = dense_reference(dense, x, ids, weights)
        fused = moe_lora.fused_apply(method, moe, x, weights.float(), ids.to(torch.int32))
        fused = fused.float().clone()
        got = decomposed(moe, x, ids, weights, token_loop=path == "token-loop")
        rows[m] = (error(got, ref), error(got, fused), error(fused, ref))
    record(
        f"P13 decomposed experts, {name}, {path}", **{f"{m} tokens": [round(e, 5) for e in r] for m, r in rows.items()}
    )
    assert all(max(r) < TOLERANCE for r in rows.values()), rows


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


# -- the whole of Exl3LoRAExperts.apply, LoRA deltas included, against aphrodite's own TritonExperts ---------------


def lora_context(
    experts: int, hidden: int, inter: int, top_k: int, slices: int, token_ids, rank: int = 8, both: bool = False
):
    """A real ``MoELoRAContext`` for two adapter slots over a real ``PunicaWrapperGPU`` whose token mapping is
    ``token_ids`` (0: no adapter; 1 and 2: slots 0 and 1). Slot 0 carries random expert weights, slot 1 zeros (an
    adapter without expert weights, like lora-a) or, with ``both``, weights of its own. ``slices``: 2 = the
    per-expert form (gate and up apart, ``FusedMoEWithLoRA``), 1 = PEFT's fused form (``FusedMoE3DWithLoRA``: one
    w13 slice of 2I rows)."""
    import dataclasses
    import inspect

    from aphrodite.config.lora import LoRAConfig
    from aphrodite.lora.layers.utils import LoRAMapping
    from aphrodite.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    context_cls = inspect.getmodule(moe_lora.lora_experts_mixin()).MoELoRAContext  # imported there on 0.21+
    gen = torch.Generator().manual_seed(7)

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).cuda()

    w13_rows = inter if slices == 2 else 2 * inter
    w13_a = tuple(rand(2, experts, rank, hidden, scale=0.02) for _ in range(slices))
    w13_b = tuple(rand(2, experts, w13_rows, rank, scale=0.5 / rank**0.5) for _ in range(slices))
    w2_a, w2_b = (rand(2, experts, rank, inter, scale=0.05),), (rand(2, experts, hidden, rank, scale=0.5 / rank**0.5),)
    for t in (*w13_a, *w13_b, *w2_a, *w2_b) if not both else ():
        t[1].zero_()  # slot 1: an adapter without expert weights
    config = LoRAConfig(max_lora_rank=rank, max_loras=2, lora_dtype=torch.bfloat16)
    punica = PunicaWrapperGPU(512, 16, "cuda", lora_config=config)
    ids = tuple(int(i) for i in token_ids)
    punica.update_metadata(LoRAMapping(ids, ids, is_prefill=True), [1, 2], 2, 1024)
    values = dict(
        w13_lora_a_stacked=w13_a, w13_lora_b_stacked=w13_b, w2_lora_a_stacked=w2_a, w2_lora_b_stacked=w2_b,
        adapter_enabled=torch.tensor([1, 1, 0], dtype=torch.int, device="cuda"), max_loras=2, top_k=top_k,
        w13_num_slices=slices, fully_sharded=False, tp_rank=0, tp_size=1, local_num_experts=experts,
        punica_wrapper=punica, use_tuned_config=False,
    )  # fmt: skip
    names = {f.name for f in dataclasses.fields(context_cls)}
    return context_cls(**{k: v for k, v in values.items() if k in names})


def run_experts(experts, x, w1, w2, weights, ids):
    """``experts.apply`` with buffers laid out as the modular kernel lays them out: the output a view of
    workspace13's memory (``_allocate_buffers``)."""
    from aphrodite.model_executor.layers.fused_moe.activation import MoEActivation

    m, k = ids.shape
    e, n, hidden = w1.shape
    ws13, ws2, out = experts.workspace_shapes(m, n, hidden, k, e, e, None, MoEActivation.SILU)
    numel = lambda shape: int(torch.tensor(shape).prod())  # noqa: E731
    common = torch.empty(max(numel(ws13), numel(out)), dtype=x.dtype, device="cuda")
    workspace2 = torch.empty(numel(ws2), dtype=x.dtype, device="cuda").view(ws2)
    output = common[: numel(out)].view(out)
    experts.apply(
        output, x, w1, w2, weights, ids, MoEActivation.SILU, e, None, None, None, common[: numel(ws13)].view(ws13),
        workspace2, None, False,
    )  # fmt: skip
    return output.float().clone()


def test_the_first_call_on_a_fresh_layer_answers_like_the_later_ones(record):
    """aphrodite 0.24.1's EXL3 MoE, one token through ``Exl3MoEMethod.apply`` (``_apply_single_token``'s
    ``exl3_mgemm`` calls): the first call on a freshly set-up layer must answer like the calls after it, and so must
    the first call on a second layer of the same shape (the kernels' per-shape state already made) and of a new
    shape. Run 34 (2026-12-08, one H100) saw the first call of each new layer width return a relative error of 1.0
    against the exact answer, every later call within 0.7 % (docs/upstream/exl3-first-call-per-shape.md)."""
    if moe_lora.lora_experts_mixin() is None:
        pytest.skip("this aphrodite has no LoRAExpertsMixin (the suite's P13 layer needs 0.21+)")
    exl3 = importlib.import_module(EXL3)
    method = exl3.Exl3MoEMethod.__new__(exl3.Exl3MoEMethod)
    rows = {}
    for name, shape in (("first layer", (512, 256, 4, 2)), ("same shape", (512, 256, 4, 2)),
                        ("new shape", (768, 256, 4, 2))):  # fmt: skip
        moe, dense = moe_layer(*shape)
        x, ids, weights = routed(1, moe.hidden_size, moe.local_num_experts, moe.top_k, seed=400)
        ref = dense_reference(dense, x, ids, weights)
        calls = [moe_lora.fused_apply(method, moe, x, weights, ids.to(torch.int32)).float().clone() for _ in range(3)]
        rows[name] = [round(error(c, ref), 5) for c in calls]
    record("EXL3 MoE first call on a fresh layer (1 token, relative error of calls 1-3)", **rows)
    assert all(max(r) < TOLERANCE for r in rows.values()), rows


def token_slots(mapping: list[int]) -> list[int]:
    """The adapter slot of each token of a ``lora_context`` mapping (0: none -> -1, 1 -> slot 0, 2 -> slot 1)."""
    return [i - 1 for i in mapping]


def lora_reference(dense, x, ids, weights, ctx, slots: list[int]):
    """The exact answer of the experts with LoRA, in float32 from the dense weights and the context's stacked LoRA
    factors: per (token, expert) assignment gate/up plus B A x (one 2I slice, or gate and up apart), SiLU-and-mul,
    down plus its B A, weighted by the router; a token of slot -1 takes no delta."""
    out = torch.zeros(x.shape[0], x.shape[1], device="cuda")
    a13 = [a.float() for a in ctx.w13_lora_a_stacked]
    b13 = [b.float() for b in ctx.w13_lora_b_stacked]
    a2, b2 = ctx.w2_lora_a_stacked[0].float(), ctx.w2_lora_b_stacked[0].float()
    xf = x.float()
    for t, slot in enumerate(slots):
        for j, e in enumerate(ids[t].tolist()):
            gate, up, down = dense[e]
            g, u = xf[t] @ gate, xf[t] @ up
            if slot >= 0:
                deltas = [b[slot, e] @ (a[slot, e] @ xf[t]) for a, b in zip(a13, b13)]
                gu = torch.cat(deltas) if len(deltas) == 2 else deltas[0]
                g, u = g + gu[: g.shape[0]], u + gu[g.shape[0] :]
            act = torch.nn.functional.silu(g) * u
            y = act @ down
            if slot >= 0:
                y = y + b2[slot, e] @ (a2[slot, e] @ act)
            out[t] += weights[t, j].float() * y
    return out


# token -> adapter patterns: tokens of the three kinds interleaved, or in runs as a server's batch holds requests
# (each request's tokens together); "both-runs": both slots carry expert weights
MAPPINGS = {
    "interleaved": lambda m: [t % 3 for t in range(m)],
    "runs": lambda m: [(0, 1, 2, 1, 0, 2)[min(5, 6 * t // m)] for t in range(m)],
    "both-runs": lambda m: [(1, 2, 0, 2, 1, 0)[min(5, 6 * t // m)] for t in range(m)],
    "no adapter": lambda m: [0] * m,  # a batch without LoRA: P13's fused path, aphrodite's experts with no delta
}


@pytest.mark.parametrize("mapping", list(MAPPINGS))
@pytest.mark.parametrize("slices", [1, 2], ids=["fused-form", "per-expert-form"])
@pytest.mark.parametrize("m", [1, 3, 16, 64, 65, 240])
def test_the_exl3_lora_experts_and_aphrodites_triton_experts_against_exact_lora(layer, slices, m, mapping, record):
    """The whole ``apply`` with LoRA, adapters mixed as ``mapping`` lays them out, against the exact float32 answer
    (``lora_reference``) and P13's experts against aphrodite's ``TritonExperts`` on the same weights and the same
    ``MoELoRAContext``: the token loop (up to 64 tokens) and the per-expert path (65 and more). Every number is
    recorded before the asserts; where aphrodite's own path is off the exact answer too, the fault is not P13's."""
    from aphrodite.model_executor.layers.fused_moe import TritonExperts
    from aphrodite.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    from helpers import fused_moe_config

    name, moe, dense = layer
    exl3 = importlib.import_module(EXL3)
    hidden, inter, e, k = moe.hidden_size, moe.exl3_intermediate_size_per_partition, moe.local_num_experts, moe.top_k
    cfg = fused_moe_config(hidden, inter, e, k, device="cuda")
    w1 = torch.stack([torch.cat([g.T, u.T]) for g, u, _ in dense]).to(torch.bfloat16).contiguous()
    w2 = torch.stack([d.T for _, _, d in dense]).to(torch.bfloat16).contiguous()
    x, ids, weights = routed(m, hidden, e, k, seed=300 + m)
    x, ids, weights = x.to(torch.bfloat16), ids.to(torch.int32), weights.float()
    tokens, both = MAPPINGS[mapping](m), mapping.startswith("both")
    ctx = lora_context(e, hidden, inter, k, slices, tokens, both=both)
    ours = moe_lora.experts_class()(exl3.Exl3MoEMethod.__new__(exl3.Exl3MoEMethod), moe, cfg,
                                    FUSED_MOE_UNQUANTIZED_CONFIG)  # fmt: skip
    theirs = TritonExperts(cfg, FUSED_MOE_UNQUANTIZED_CONFIG)
    for experts in (ours, theirs):
        experts.set_lora_context(ctx)
    shape1, shape2 = moe_lora.shape_tensors(moe, torch.bfloat16)
    row = {}
    try:
        triton_out = run_experts(theirs, x, w1, w2, weights, ids)
        ours_out = run_experts(ours, x, shape1, shape2, weights, ids)
        exact = lora_reference(dense, x, ids, weights, ctx, token_slots(tokens))
        base = dense_reference(dense, x, ids, weights)
        adapted = torch.tensor([t > 0 for t in tokens], device="cuda")
        row = {
            "p13 against exact": round(error(ours_out, exact), 5),
            "triton against exact": round(error(triton_out, exact), 5),
            "p13 against triton": round(error(ours_out, triton_out), 5),
        }
        # the expert weights' effect, where a token maps to a slot that has them (slot 0; slot 1 with "both")
        weighted = torch.tensor([t == 1 or (t == 2 and both) for t in tokens], device="cuda")
        if adapted.any():
            row["p13 against exact, adapter tokens"] = round(error(ours_out[adapted], exact[adapted]), 5)
            row["triton against exact, adapter tokens"] = round(error(triton_out[adapted], exact[adapted]), 5)
        if weighted.any():
            row["lora's effect"] = round(error(base, exact), 5)
    except Exception as exc:  # noqa: BLE001 - recorded, then raised
        row = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        raise
    finally:
        record(f"P13 LoRA experts against exact LoRA, {name}, {m} tokens, {slices} slice(s), {mapping}", **row)
    assert row.get("lora's effect", 1.0) > 5 * TOLERANCE, row  # the deltas matter (a batch of no adapter: none)
    assert row["p13 against exact"] < TOLERANCE, row
