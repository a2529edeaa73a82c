"""P16 (EXL3 routed experts at 2 - 32 tokens: one ``exl3_mgemm`` per projection for every token's experts) against the
real aphrodite-engine modules of the lane's release (CPU).

The release's ``Exl3MoEMethod._apply_small_batch`` is run as shipped, and P16's replacement as installed on the real
class. Their kernels need a GPU, so both run here on reference CPU kernels registered under the names the release
calls (``torch.ops._C.exl3_mgemm``, ``make_gate_up_indices``, ``silu_mul``), written from the kernel's contract in
csrc/quantization/exl3/exllamav3_ext/quant/exl3_gemm.cu (``A[j] @ B[indices[j]] -> C[j]``, ``A[0]`` broadcast when
A has one slot, with weights every slot weighted and summed into ``C[0]``), over real EXL3 experts (random trellises,
decoded by the project's codec). The fake kernels are inputs: aphrodite's modules are not replaced. On the GPU:
bench/exl3_moe_small_batch.py (the real kernels, eager and in CUDA graphs, against the loop) and
tests/upstream/tests/kernels/moe/test_exl3_moe_small_batch.py. The bug: docs/upstream/exl3-moe-small-batch-per-token.md.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from helpers import APHRODITE_VERSION, needs_aphrodite

pytestmark = needs_aphrodite

MODULE = "hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3.p16_moe_small_batch"
EXPERTS, TOP_K, HIDDEN, INTER, K = 8, 2, 128, 256, 3


def p16():
    import importlib

    return importlib.import_module(MODULE)


class ReferenceKernels:
    """CPU kernels for the three ops the small-batch paths call, counting the GEMM calls; B tables hold keys into
    ``dense`` (the experts' exact dense weights) instead of device addresses."""

    def __init__(self, dense: dict[int, torch.Tensor]):
        self.dense, self.mgemm_calls = dense, 0

    def exl3_mgemm(self, a, b, c, suh, a_had, svh, indices, weights, k, *rest):
        self.mgemm_calls += 1
        slots = max(a.shape[0], c.shape[0]) if indices is None else indices.shape[1]
        results = []
        for j in range(slots):
            q = int(indices[0, j]) if indices is not None else j
            row = a[0 if a.shape[0] == 1 else j].float()
            y = row @ self.dense[int(b[q])]
            results.append(y * float(weights.reshape(-1)[j]) if weights is not None else y)
        if weights is not None:
            c[0] = sum(results).to(c.dtype)
        else:
            for j, y in enumerate(results):
                c[j] = y.to(c.dtype)

    @staticmethod
    def make_gate_up_indices(out, indices, offset):
        flat = indices.reshape(-1)
        out.view(-1)[: flat.numel()] = flat
        out.view(-1)[flat.numel() : 2 * flat.numel()] = flat + offset

    @staticmethod
    def silu_mul(out, gate, up):
        out.copy_((torch.nn.functional.silu(gate.float()) * up.float()).to(out.dtype))


@pytest.fixture
def kernels(monkeypatch):
    """The reference kernels as ``torch.ops._C``'s ops for this test (the CPU wheel has no ``_C``)."""
    from hybrid_exl3_fixes.checkpoint import codec

    generator = torch.Generator().manual_seed(0)
    dense, tables = {}, {}
    for shards, (k, n) in ((("w1", "w3"), (HIDDEN, INTER)), (("w2",), (INTER, HIDDEN))):
        for shard in shards:
            keys = []
            for _ in range(EXPERTS):
                key = len(dense) + 1
                dense[key] = codec.dense_weight(codec.random_exl3_linear(k, n, K, "mcg", generator, scale=0.05), K)
                keys.append(key)
            tables[shard] = torch.tensor(keys)
    reference = ReferenceKernels(dense)
    ops_c = types.SimpleNamespace(
        exl3_mgemm=reference.exl3_mgemm,
        make_gate_up_indices=reference.make_gate_up_indices,
        silu_mul=reference.silu_mul,
    )
    monkeypatch.setattr(torch.ops, "_C", ops_c, raising=False)  # torch's op namespace, absent on a CPU wheel
    return reference, tables


def loaded_layer(tables, threshold=4, fuse=True):
    """The attributes ``_setup_fused_moe_kernel`` leaves on a loaded EXL3 MoE layer (0.21+; 0.20 has no fused
    gate-up tables), their pointer tables holding the reference kernels' keys."""
    gate, up, down = tables["w1"], tables["w3"], tables["w2"]
    zeros = torch.zeros(EXPERTS, dtype=torch.long)
    return types.SimpleNamespace(
        local_num_experts=EXPERTS,
        top_k=TOP_K,
        hidden_size=HIDDEN,
        exl3_intermediate_size_per_partition=INTER,
        exl3_small_batch_threshold=threshold,
        exl3_gate_ptrs_trellis=gate,
        exl3_up_ptrs_trellis=up,
        exl3_down_ptrs_trellis=down,
        **{f"exl3_{p}_ptrs_{a}": zeros for p in ("gate", "up", "down") for a in ("suh", "svh")},
        exl3_gate_up_ptrs_trellis=torch.cat([gate, up]),
        exl3_gate_up_ptrs_suh=torch.cat([zeros, zeros]),
        exl3_gate_up_ptrs_svh=torch.cat([zeros, zeros]),
        exl3_moe_k_gate=K,
        exl3_moe_k_up=K,
        exl3_moe_k_down=K,
        **{f"exl3_{p}_{cb}": cb == "mcg" for p in ("gate", "up", "down") for cb in ("mcg", "mul1")},
        exl3_down_force_shape=-1,
        exl3_down_force_num_sms=0,
        exl3_fuse_gate_up=fuse,
        exl3_small_yh_gu=torch.zeros(TOP_K * 2, 1, HIDDEN, dtype=torch.float16),
        exl3_small_yh=torch.zeros(TOP_K, 1, HIDDEN, dtype=torch.float16),
        exl3_small_interm_gu=torch.zeros(TOP_K * 2, 1, INTER, dtype=torch.float16),
        exl3_small_gate_up_ids=torch.zeros(1, TOP_K * 2, dtype=torch.long),
        exl3_small_interm_a=torch.zeros(TOP_K, 1, INTER, dtype=torch.float16),
        exl3_small_out_d=torch.zeros(TOP_K, 1, HIDDEN, dtype=torch.float32),
        exl3_small_batch_out=torch.zeros(threshold, HIDDEN, dtype=torch.float32),
    )


def with_gate_up_views(layer):
    layer.exl3_small_interm_g = layer.exl3_small_interm_gu[:TOP_K]
    layer.exl3_small_interm_u = layer.exl3_small_interm_gu[TOP_K:]
    return layer


def batch(rows, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, HIDDEN, generator=generator) * 0.5).half()
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(rows)])
    weights = torch.softmax(torch.randn(rows, TOP_K, generator=generator), -1).half()
    return x, ids, weights


def dense_moe(dense, tables, x, ids, weights):
    """Each token's experts, weighted and summed, in float32 from the exact dense weights."""
    out = torch.zeros(x.shape[0], HIDDEN)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            e = int(ids[t, j])
            gate = x[t].float() @ dense[int(tables["w1"][e])]
            up = x[t].float() @ dense[int(tables["w3"][e])]
            act = (torch.nn.functional.silu(gate) * up).half().float()
            out[t] += float(weights[t, j]) * (act @ dense[int(tables["w2"][e])])
    return out


def small_batch(method, layer, x, ids, weights):
    return method._apply_small_batch(layer, x, ids, weights, torch.bfloat16, (x.shape[0],))


def test_the_release_launches_the_experts_once_per_token(overlay, kernels):
    """The bug: the release's own small-batch path, on 4 tokens, calls exl3_mgemm per token (2 or 3 a token)."""
    from aphrodite.model_executor.layers.quantization import exl3

    overlay.undo_all()
    reference, tables = kernels
    module = p16()
    assert module.PATCH.probe({module.MOE_SMALL_BATCH.key: overlay.REGISTRY._resolve(module.MOE_SMALL_BATCH)})
    x, ids, weights = batch(4)
    method = exl3.Exl3MoEMethod.__new__(exl3.Exl3MoEMethod)
    out = small_batch(method, with_gate_up_views(loaded_layer(tables)), x, ids, weights)
    per_token = 3 if APHRODITE_VERSION == "0.20.0" else 2  # 0.20 has no fused gate-up
    assert reference.mgemm_calls == 4 * per_token
    expected = dense_moe(reference.dense, tables, x, ids, weights)
    assert float((out.float() - expected).norm() / expected.norm()) < 2e-2


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("rows", [2, 3, 4])
def test_p16_launches_each_projection_once_for_every_token(overlay, kernels, rows, fuse):
    """With the overlay the live method computes the same MoE with 2 (fused gate-up) or 3 GEMM calls, whatever N."""
    from aphrodite.model_executor.layers.quantization import exl3

    results = {r.patch.id: r for r in overlay.apply_all()}
    assert results["P16"].status.value == "APPLIED", results["P16"].reason
    live = vars(exl3.Exl3MoEMethod)["_apply_small_batch"]
    assert getattr(live, "__hybrid_exl3_fixes_patch__", None) == "P16"
    reference, tables = kernels
    x, ids, weights = batch(rows, seed=rows)
    layer = with_gate_up_views(loaded_layer(tables, fuse=fuse))
    out = small_batch(exl3.Exl3MoEMethod.__new__(exl3.Exl3MoEMethod), layer, x, ids, weights)
    fused = fuse and APHRODITE_VERSION != "0.20.0"  # 0.20's custom ops have no make_gate_up_indices
    assert reference.mgemm_calls == (2 if fused else 3)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, HIDDEN)
    expected = dense_moe(reference.dense, tables, x, ids, weights)
    assert float((out.float() - expected).norm() / expected.norm()) < 2e-2
    overlay.undo_all()
    assert vars(exl3.Exl3MoEMethod)["_apply_small_batch"] is not live


def test_p16_leaves_a_layer_without_the_releases_tables_to_the_release(overlay, kernels):
    """A layer without the pointer tables _setup_fused_moe_kernel leaves: the original runs."""
    from aphrodite.model_executor.layers.quantization import exl3

    overlay.apply_all()
    reference, tables = kernels
    method = exl3.Exl3MoEMethod.__new__(exl3.Exl3MoEMethod)
    layer = with_gate_up_views(loaded_layer(tables))
    del layer.exl3_moe_k_down
    layer.exl3_moe_k_down_tuned = K  # what a release that renamed it would hold; the loop below reads neither
    x, ids, weights = batch(3)
    with pytest.raises(AttributeError, match="exl3_moe_k_down"):  # the release's own loop, not P16's batch
        small_batch(method, layer, x, ids, weights)
    assert reference.mgemm_calls == (2 if APHRODITE_VERSION == "0.20.0" else 1)  # stopped at the first down


def test_a_call_at_the_35b_a3b_threshold_takes_under_7_mib():
    assert p16().call_bytes(32, 8, 2048, 512) == 7_081_984  # 6.75 MiB, freed after the layer


def test_the_probe_reads_a_loop_without_one_as_fixed():
    module = p16()

    def looped(self, layer, x_2d, topk_ids, topk_weights, original_dtype, original_shape):
        for i in range(x_2d.shape[0]):
            ops.exl3_mgemm(x_2d[i])  # noqa: F821 - read, never run

    def batched(self, layer, x_2d, topk_ids, topk_weights, original_dtype, original_shape):
        ops.exl3_mgemm(x_2d)  # noqa: F821

    assert module.loops_over_tokens(looped) and not module.loops_over_tokens(batched)
    assert "exl3_mgemm" in inspect.getsource(looped)
