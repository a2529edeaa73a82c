"""P7 (EXL3 routed experts in a CUDA graph: the captured batch is chunked so that no expert gets more tokens
than ops.exl3_moe takes) against the real aphrodite-engine modules of the lane's release (CPU).

Every release from 0.20.0 to 0.24.1 returns from ``Exl3MoEMethod.apply`` right after the fused kernel while a
graph is captured, before the fallback that computes the experts the kernel skipped (over 128 tokens). The
kernel itself needs a GPU: tests/upstream/tests/kernels/moe/test_exl3_moe_graph_capacity.py runs it (run 13,
H200, 0.21.0: relative error 1.000 unpatched, passes with P7). Here: the release's code as the probe reads it,
the patch's records on the real class, and the wrapper's chunking with a recording stand-in for the original
(fake input; aphrodite's modules are not replaced)."""

from __future__ import annotations

import types

import pytest
import torch

from helpers import needs_aphrodite
from hybrid_exl3_fixes.registry import wrapper_chain

pytestmark = needs_aphrodite

P7 = "hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3.p7_moe_graph"


def p7():
    import importlib

    return importlib.import_module(P7)


def live_apply(overlay):
    module = p7()
    return {module.MOE_APPLY.key: overlay.REGISTRY._resolve(module.MOE_APPLY)}


def test_the_release_skips_the_fallback_while_capturing(overlay):
    """The real apply calls ops.exl3_moe and then returns from a capture branch (the bug)."""
    overlay.undo_all()
    assert p7().PATCH.probe(live_apply(overlay)) is True


def test_p7_wraps_the_real_method_and_undo_restores_it(overlay):
    from aphrodite.model_executor.layers.quantization import exl3

    original = vars(exl3.Exl3MoEMethod)["apply"]
    result = {r.patch.id: r for r in overlay.apply_all()}["P7"]
    assert result.status.value == "APPLIED", result.reason
    wrapper = vars(exl3.Exl3MoEMethod)["apply"]
    assert wrapper is not original and wrapper_chain(wrapper)[-1] is original  # P9 between them on 0.23+
    assert wrapper.__hybrid_exl3_fixes_patch__ == "P7"
    assert p7().PATCH.probe(live_apply(overlay)) is False  # re-probed: its chunks are safe
    overlay.undo_all()
    assert vars(exl3.Exl3MoEMethod)["apply"] is original


# today's capacities: 128 tokens per expert (0.20-0.24), and 0.24's SM110 (32; 1 for batches of up to 32)
LAYERS = {
    "default": types.SimpleNamespace(exl3_small_batch_threshold=2, exl3_moe_max_tokens_per_expert=128, hidden_size=16),
    "sm110": types.SimpleNamespace(
        exl3_small_batch_threshold=4,
        exl3_moe_max_tokens_per_expert=32,
        exl3_moe_short_token_threshold=32,
        exl3_moe_short_max_tokens_per_expert=1,
    ),
    "0.21": types.SimpleNamespace(exl3_small_batch_threshold=4, hidden_size=16),  # the module constant: 128
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_every_chunk_is_safe_and_they_cover_the_batch(name):
    module, layer = p7(), LAYERS[name]
    for rows in range(1, 700):
        sizes = module.chunk_rows(layer, rows)
        assert sum(sizes) == rows
        for size in sizes:
            per_token = size == 1 or size <= layer.exl3_small_batch_threshold
            assert per_token or size <= module.expert_capacity(layer, size), (rows, sizes)
    assert module.chunk_rows(LAYERS["0.21"], 300) == [128, 128, 44]


def recording_wrapper(calls):
    def original(self, layer, x, topk_weights, topk_ids, *rest):
        rows = x.numel() // x.shape[-1]
        calls.append((rows, topk_weights.shape, topk_ids.shape, rest))
        out = x.reshape(rows, -1).float() * 2 + topk_ids.reshape(rows, -1)[:, :1].float()
        return out.to(x.dtype).reshape(x.shape)

    live = {p7().MOE_APPLY.key: types.SimpleNamespace(function=original)}
    return p7().build_moe_graph_capacity(live)[p7().MOE_APPLY.key]


def test_outside_a_graph_the_original_gets_the_call_unchanged(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU torch cannot answer
    calls = []
    apply = recording_wrapper(calls)
    x = torch.randn(300, 16, dtype=torch.bfloat16)
    ids = torch.arange(600).reshape(300, 2) % 4
    out = apply(None, LAYERS["0.21"], x, torch.ones(300, 2), ids, "shared", None)  # 0.22+ arguments
    assert calls == [(300, torch.Size([300, 2]), torch.Size([300, 2]), ("shared", None))]
    assert torch.equal(out, (x.float() * 2 + ids[:, :1].float()).to(torch.bfloat16))


def test_while_capturing_the_batch_goes_in_safe_chunks_and_comes_back_in_order(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # torch's, not aphrodite's
    calls = []
    apply = recording_wrapper(calls)
    x = torch.randn(2, 150, 16, dtype=torch.bfloat16)  # 300 tokens in a 3-d batch
    ids = (torch.arange(600).reshape(300, 2) * 7) % 4
    out = apply(None, LAYERS["0.21"], x, torch.ones(300, 2), ids, None)  # 0.20 / 0.21 arguments
    assert [c[0] for c in calls] == [128, 128, 44]
    assert all(c[3] == (None,) for c in calls)
    expected = (x.reshape(300, 16).float() * 2 + ids[:, :1].float()).to(torch.bfloat16).reshape(2, 150, 16)
    assert out.shape == x.shape and out.dtype == x.dtype and torch.equal(out, expected)
    calls.clear()
    apply(None, LAYERS["0.21"], x[:, :64], torch.ones(128, 2), ids[:128], None)  # 128 tokens: cannot overflow
    assert [c[0] for c in calls] == [128]
