"""P9 (EXL3 routed experts and padding rows: expert id -1) against the real aphrodite-engine modules of the lane's
release (CPU).

0.23.0 - 0.24.1 give the rows a CUDA-graph batch or the profiling run is padded with the expert id -1
(``APHRODITE_MOE_SKIP_PADDING``, on by default since 0.23.0). ``Exl3MoEMethod.apply`` counts tokens per expert with
``scatter_add_``, which on the GPU is the device-side assert every EXL3 MoE hybrid stopped at in run 15 (H200,
0.24.1, with and without the overlay's other fixes and LoRA; docs/upstream/exl3-moe-padding-expert-ids.md). The
same line on the CPU raises an index error, so the release's own method shows the bug here; the kernel after it
needs a GPU: on the CPU the method then stops at its next CUDA call (``torch.cuda.is_current_stream_capturing()``,
which a CPU-only torch refuses, or "EXL3 MoE kernel is not available"), which is how these tests see that the ids
got past the count. Fake inputs (a layer's attributes, tensors); aphrodite's modules are real."""

from __future__ import annotations

import pytest
import torch

from helpers import APHRODITE_VERSION, fake_exl3_moe_layer, needs_aphrodite
from hybrid_exl3_fixes.registry import wrapper_chain

pytestmark = needs_aphrodite

MODULE = "hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3.p9_moe_padding"
PADDING_RELEASES = ("0.23.0", "0.24.0", "0.24.1")  # APHRODITE_MOE_SKIP_PADDING in the fused top-k routers
needs_padding_ids = pytest.mark.skipif(
    APHRODITE_VERSION not in PADDING_RELEASES,
    reason=f"aphrodite {APHRODITE_VERSION}'s routers never give EXL3 experts the id -1 (0.23.0+ do)",
)


def p9():
    import importlib

    return importlib.import_module(MODULE)


def live_apply(overlay):
    module = p9()
    return {module.MOE_APPLY.key: overlay.REGISTRY._resolve(module.MOE_APPLY)}


def padded_batch(rows=8, real=5, top_k=2, experts=4, hidden=16):
    """A batch whose last ``rows - real`` rows are padding, as 0.23+'s top-k kernel writes them (id -1)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=generator).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(rows)])
    ids[real:] = -1
    weights = torch.rand(rows, top_k, generator=generator)
    return x, weights, ids


# what the release's apply meets after the count, on a machine without the kernels
PAST_THE_COUNT = ("_cuda_isCurrentStreamCapturing", "EXL3 MoE kernel is not available")


def past_the_count(message: str) -> bool:
    return any(text in message for text in PAST_THE_COUNT) and "out of bounds" not in message


def call_apply(x, weights, ids, the_layer):
    from aphrodite.model_executor.layers.quantization import exl3

    method = object.__new__(exl3.Exl3MoEMethod)
    with pytest.raises(RuntimeError) as caught:
        exl3.Exl3MoEMethod.apply(method, the_layer, x, weights, ids, None, None)
    return str(caught.value)


@needs_padding_ids
def test_the_release_cannot_count_a_padding_row(overlay):
    """The real apply, unpatched, fails on the expert count (on the GPU: the device-side assert of run 15)."""
    overlay.undo_all()
    assert p9().PATCH.probe(live_apply(overlay)) is True
    message = call_apply(*padded_batch(), fake_exl3_moe_layer())
    assert "out of bounds" in message, message
    real_rows_only = padded_batch(rows=5, real=5)  # the same call without padding rows gets past the count
    assert past_the_count(call_apply(*real_rows_only, fake_exl3_moe_layer()))


@needs_padding_ids
def test_p9_lets_the_padding_rows_through_and_undo_restores_the_release(overlay):
    from aphrodite.model_executor.layers.quantization import exl3

    original = vars(exl3.Exl3MoEMethod)["apply"]
    results = {r.patch.id: r for r in overlay.apply_all()}
    assert results["P9"].status.value == "APPLIED", results["P9"].reason
    assert results["P7"].status.value == "APPLIED", results["P7"].reason
    outer = vars(exl3.Exl3MoEMethod)["apply"]
    chain = wrapper_chain(outer)
    # P7 outermost (it chunks captured batches), P9 under it (each chunk sanitised for its own size), then the release
    assert [getattr(f, "__hybrid_exl3_fixes_patch__", None) for f in chain] == ["P7", "P9", None]
    assert chain[-1] is original
    assert p9().PATCH.probe(live_apply(overlay)) is False  # it finds itself under P7
    # (P7's wrapper asks is_current_stream_capturing first, which a CPU-only torch refuses: the next test
    # calls P9 with P7 switched off)
    overlay.undo_all()
    assert vars(exl3.Exl3MoEMethod)["apply"] is original


@needs_padding_ids
def test_undo_of_p9_under_p7_is_refused_and_changes_nothing(overlay):
    """P7 wraps P9's wrapper of the same ``Exl3MoEMethod.apply``: undoing P9 first would restore the release's
    apply under P7's result. The registry refuses it, naming what is on top, and undoes in reverse order."""
    from aphrodite.model_executor.layers.quantization import exl3

    from hybrid_exl3_fixes.registry import UndoOrder

    original = vars(exl3.Exl3MoEMethod)["apply"]
    results = {r.patch.id: r for r in overlay.apply_all()}
    patches = {p.id: p for p in overlay.PATCHES}
    outer = vars(exl3.Exl3MoEMethod)["apply"]
    with pytest.raises(UndoOrder, match="P9 cannot be undone while .*P7"):
        overlay.REGISTRY.undo(patches["P9"])
    assert vars(exl3.Exl3MoEMethod)["apply"] is outer  # nothing restored
    assert overlay.REGISTRY.results["P7"] is results["P7"] and overlay.REGISTRY.results["P9"] is results["P9"]
    assert "P9" in overlay.REGISTRY.applied_ids()
    for later in reversed(overlay.REGISTRY.applied_ids()[overlay.REGISTRY.applied_ids().index("P9") + 1 :]):
        assert overlay.REGISTRY.undo(patches[later])
    assert [
        getattr(f, "__hybrid_exl3_fixes_patch__", None) for f in wrapper_chain(vars(exl3.Exl3MoEMethod)["apply"])
    ] == ["P9", None]
    assert overlay.REGISTRY.undo(patches["P9"]) and vars(exl3.Exl3MoEMethod)["apply"] is original
    assert "P9" not in overlay.REGISTRY.results and not overlay.REGISTRY.undo(patches["P9"])
    overlay.undo_all()


@needs_padding_ids
def test_p9_alone_when_p7_is_switched_off(overlay, monkeypatch):
    monkeypatch.setenv("HYBRID_EXL3_FIXES_DISABLE", "P7")
    results = {r.patch.id: r.status.value for r in overlay.apply_all()}
    assert results["P9"] == "APPLIED" and results["P7"] == "DISABLED"
    message = call_apply(*padded_batch(), fake_exl3_moe_layer())
    assert past_the_count(message), message


@pytest.mark.skipif(APHRODITE_VERSION in PADDING_RELEASES, reason="this release does give padding rows id -1")
def test_not_applicable_where_the_routers_never_give_minus_one(overlay):
    result = {r.patch.id: r for r in overlay.apply_all()}["P9"]
    assert result.status.value == "NOT_APPLICABLE", result.reason
    assert "0.23+" in result.reason


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 40])
def test_every_padding_id_becomes_one_its_path_takes(rows):
    """Large batches: the spare last slot of the expert count (the kernel and the fallback read only the first
    ``local_num_experts``); one-token and small batches index the experts' pointer tables: a real expert."""
    the_layer = fake_exl3_moe_layer(threshold=2, experts=4)
    _, _, ids = padded_batch(rows=rows, real=rows // 2, experts=4)
    safe = p9().padding_safe_ids(the_layer, rows, ids)
    real = ids >= 0
    assert torch.equal(safe[real], ids[real])  # real rows untouched
    per_token = rows == 1 or rows <= the_layer.exl3_small_batch_threshold
    padding = safe[~real]
    if per_token:
        assert ((padding >= 0) & (padding < 4)).all()
    else:
        assert (padding == 4).all()
        counts = torch.zeros(5, dtype=torch.long).scatter_add_(
            0, safe.reshape(-1), torch.ones(safe.numel(), dtype=torch.long)
        )
        assert counts[:4].sum() == real.sum() and counts[4] == (~real).sum()


def test_the_probe_reads_an_upstream_fix():
    """A release whose apply maps negative ids itself (as patches/0009 does) is UPSTREAM_FIXED, not patched again."""

    def fixed(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        topk_ids = topk_ids.to(torch.long)
        padding = topk_ids < 0
        return padding

    def buggy(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        topk_ids = topk_ids.to(torch.long)
        return topk_ids.shape[-1] == 1

    assert p9().handles_negative_ids(fixed) is True
    assert p9().handles_negative_ids(buggy) is False


@needs_padding_ids
def test_the_upstream_diff_fixes_what_the_probe_looks_for(aphrodite_copy):
    """patches/0009 applied to the release's sources: P9 finds nothing to fix (UPSTREAM_FIXED), P7 still applies."""
    import subprocess

    from helpers import ROOT, by_id, run_status

    patch = ROOT / "patches" / "0009-exl3-moe-padding-expert-ids.patch"
    proc = subprocess.run(["git", "apply", str(patch)], cwd=aphrodite_copy, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    code, report = run_status(aphrodite_copy)
    assert by_id(report)["P9"]["status"] == "UPSTREAM_FIXED", by_id(report)["P9"]
    assert by_id(report)["P7"]["status"] == "APPLIED"


@needs_padding_ids
def test_a_fresh_registry_sees_p9_under_p7(overlay):
    """The module reloaded (its state lost): P9's tag, one wrapper down, still means "already patched"."""
    from hybrid_exl3_fixes.registry import Registry

    overlay.apply_all()
    fresh = Registry(overlay.PATCHES)
    again = {p.id: fresh.apply(p).reason for p in overlay.PATCHES if p.id in ("P7", "P9")}
    assert again == {"P7": "already patched in this process", "P9": "already patched in this process"}
