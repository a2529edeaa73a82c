"""P10 (EXL3 routed experts: the fused kernel's device context before CUDA-graph capture) against the real
aphrodite-engine modules of the lane's release (CPU).

0.24.0 - 0.24.1: ``ops.exl3_moe`` takes ``num_active`` and its kernel returns before it allocates exllamav3's
device context when no expert has work; the routers give every warm-up row expert id -1 (0.23+). The first launch
then falls inside the first captured CUDA graph, which stops every EXL3 MoE model at start-up in the default
compiled mode (docs/upstream/exl3-moe-context-in-capture.md). The kernel needs a GPU (tests/upstream's
test_exl3_moe_context_capture.py); here: the probe on every release, the wrapper, and that the warm-up's inputs
take the release's own fused-kernel path. Fake inputs (a layer's attributes, tensors); aphrodite's modules are
real."""

from __future__ import annotations

import importlib
import logging
import types

import pytest
import torch

from helpers import APHRODITE_VERSION, fake_exl3_moe_layer, needs_aphrodite

pytestmark = needs_aphrodite

MODULE = "hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3.p10_moe_context"
IDLE_SKIP_RELEASES = ("0.24.0", "0.24.1")  # exl3_moe(num_active): the kernel skips idle launches
needs_idle_skip = pytest.mark.skipif(
    APHRODITE_VERSION not in IDLE_SKIP_RELEASES,
    reason=f"aphrodite {APHRODITE_VERSION}'s exl3_moe launches on every call or never sees padding (0.24+ skip)",
)


def p10():
    return importlib.import_module(MODULE)


class Recorder:
    """A stand-in method whose ``apply`` has the release's signature and keeps what it was given."""

    def __init__(self, apply_signature):
        self.calls = []
        recorder = self

        def apply(self, layer, x, topk_weights, topk_ids, *rest, **kwargs):
            recorder.calls.append((x, topk_weights, topk_ids, kwargs))

        apply.__signature__ = apply_signature
        self.method = type("Method", (), {"apply": apply})()


@needs_idle_skip
def test_the_release_is_buggy_and_p10_wraps_the_load(overlay):
    from aphrodite.model_executor.layers.quantization import exl3

    original = vars(exl3.Exl3MoEMethod)["process_weights_after_loading"]
    result = {r.patch.id: r for r in overlay.apply_all()}["P10"]
    assert result.status.value == "APPLIED", result.reason
    wrapper = vars(exl3.Exl3MoEMethod)["process_weights_after_loading"]
    assert wrapper.__hybrid_exl3_fixes_patch__ == "P10" and wrapper is not original
    live = {p10().MOE_LOAD.key: overlay.REGISTRY._resolve(p10().MOE_LOAD)}
    assert p10().PATCH.probe(live) is False  # finds itself
    overlay.undo_all()
    assert vars(exl3.Exl3MoEMethod)["process_weights_after_loading"] is original


@pytest.mark.skipif(APHRODITE_VERSION in IDLE_SKIP_RELEASES, reason="this release's kernel does skip idle launches")
def test_not_applicable_where_every_warmup_launches_the_kernel(overlay):
    result = {r.patch.id: r for r in overlay.apply_all()}["P10"]
    assert result.status.value == "NOT_APPLICABLE", result.reason
    assert "0.23+" in result.reason or "0.24+" in result.reason, result.reason


@pytest.mark.parametrize("experts, top_k, threshold", [(4, 2, 2), (32, 8, 4), (256, 8, 32), (3, 3, 1)])
def test_the_warmup_gives_the_fused_kernel_work_and_nothing_else(experts, top_k, threshold):
    """More rows than the per-token paths take, distinct real experts in each row, every expert far below the
    kernel's capacity (no fallback), weight 0, and the shared-expert arguments of the release's signature."""
    import inspect

    from aphrodite.model_executor.layers.quantization import exl3

    recorder = Recorder(inspect.signature(exl3.Exl3MoEMethod.apply))
    the_layer = fake_exl3_moe_layer(threshold=threshold, experts=experts, top_k=top_k)
    rows = p10().warm_fused_kernel(recorder.method, the_layer)
    ((x, weights, ids, kwargs),) = recorder.calls
    assert rows == x.shape[0] > max(1, threshold) and ids.shape == (rows, top_k)
    assert all(len(set(row.tolist())) == top_k for row in ids) and ids.min() >= 0 and ids.max() < experts
    assert int(torch.bincount(ids.reshape(-1), minlength=experts).max()) <= 2
    assert not weights.any() and not x.any() and x.dtype == torch.float16
    assert set(kwargs) == set(list(inspect.signature(exl3.Exl3MoEMethod.apply).parameters)[5:])


def test_the_warmup_reaches_the_release_s_fused_kernel_call():
    """The release's own apply, given the warm-up's inputs, takes its batched path: on the CPU it stops at its
    first CUDA question there (is_current_stream_capturing) or at the missing kernel, past the per-token paths."""
    from aphrodite.model_executor.layers.quantization import exl3

    method = object.__new__(exl3.Exl3MoEMethod)
    with pytest.raises(Exception) as caught:
        p10().warm_fused_kernel(method, fake_exl3_moe_layer())
    message = f"{type(caught.value).__name__}: {caught.value}"
    assert "_cuda_isCurrentStreamCapturing" in message or "EXL3 MoE kernel is not available" in message, message


def test_a_failed_warmup_is_logged_and_the_load_completes(caplog):
    """The original load runs first; a warm-up that raises is a WARNING naming the layer and the eager switch."""
    loaded = []

    def original(self, layer):
        loaded.append(layer)

    live = {p10().MOE_LOAD.key: types.SimpleNamespace(function=original)}
    wrapper = p10().build_moe_context_warmup(live)[p10().MOE_LOAD.key]
    broken = types.SimpleNamespace(layer_name="model.layers.3.mlp.experts")  # no kernel set-up: the warm-up fails
    with caplog.at_level(logging.WARNING, logger="hybrid_exl3_fixes"):
        wrapper(object(), broken)
    assert loaded == [broken]
    assert "P10" in caplog.text and "model.layers.3.mlp.experts" in caplog.text and "--enforce-eager" in caplog.text


def test_the_probe_reads_a_warmup_at_setup():
    """A load path that calls ops.exl3_moe itself (patches/0010's Python half) is a fix upstream."""

    class Fixed:
        def process_weights_after_loading(self, layer):
            self._setup_fused_moe_kernel(layer, None)

        @staticmethod
        def _setup_fused_moe_kernel(layer, device):
            ops = None
            ops.exl3_moe(layer)

    class Buggy:
        def process_weights_after_loading(self, layer):
            self._setup_fused_moe_kernel(layer, None)

        @staticmethod
        def _setup_fused_moe_kernel(layer, device):
            layer.exl3_moe_k_gate = 4

    assert p10().launches_at_setup(Fixed) is True
    assert p10().launches_at_setup(Buggy) is False


@needs_idle_skip
def test_the_upstream_diff_fixes_what_the_probe_looks_for(aphrodite_copy):
    """patches/0010's Python half applied to the release's sources: P10 finds nothing to fix."""
    import subprocess

    from helpers import ROOT, by_id, run_status

    patch = ROOT / "patches" / "0010-exl3-moe-context-in-capture.patch"
    proc = subprocess.run(
        ["git", "apply", "--include=aphrodite/*", str(patch)], cwd=aphrodite_copy, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    code, report = run_status(aphrodite_copy)
    assert by_id(report)["P10"]["status"] == "UPSTREAM_FIXED", by_id(report)["P10"]
    assert by_id(report)["P9"]["status"] == "APPLIED"
