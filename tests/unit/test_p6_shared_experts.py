"""P6 (an EXL3 shared expert kept on the main CUDA stream) against the real aphrodite-engine modules of the
lane's release (CPU).

0.20.0 asks the quant method (Exl3MoEMethod.supports_shared_expert_overlap is False) and keeps EXL3 off the
auxiliary stream; 0.21.0 - 0.24.1 no longer ask, so an EXL3 shared expert may run there beside the EXL3
routed experts, whose kernels share one lock array. The stand-in SharedExperts below has an EXL3 shared
expert and nothing else (fake input): code that goes past the EXL3 question raises AttributeError, which is
how the tests tell "answered NO_OVERLAP for EXL3" from "went on to choose a stream"."""

from __future__ import annotations

import pytest
import torch

from helpers import APHRODITE_VERSION, needs_aphrodite

pytestmark = needs_aphrodite


def shared_experts_class():
    from aphrodite.model_executor.layers.fused_moe.runner import shared_experts

    return shared_experts.SharedExperts


def plain_shared_experts():
    """A stand-in whose shared expert is an ordinary (unquantized) MLP."""
    shared = object.__new__(shared_experts_class())
    expert = torch.nn.Module()
    expert.down_proj = torch.nn.Linear(4, 4)
    shared.__dict__["_layer"] = expert
    return shared


def test_the_release_reads_the_quant_methods_opt_out_only_on_0_20(overlay):
    from aphrodite.model_executor.layers.quantization import exl3

    from hybrid_exl3_fixes.aphrodite.model_executor.layers.fused_moe.runner.shared_experts import PATCH

    assert exl3.Exl3MoEMethod.__dict__["supports_shared_expert_overlap"].fget(None) is False  # EXL3's own ask
    has_bug = PATCH.probe({t.key: overlay.REGISTRY._resolve(t) for t in PATCH.targets})
    assert has_bug == (APHRODITE_VERSION != "0.20.0")


def test_an_exl3_shared_expert_is_kept_on_the_main_stream(overlay):
    """Unpatched (0.21+), the order function goes on past an EXL3 shared expert to the parallel config and
    the stream (a real server then picks the aux stream for <= 256 tokens); with P6 it answers NO_OVERLAP."""
    from aphrodite.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

    from hybrid_exl3_fixes.aphrodite.model_executor.layers.fused_moe.runner.shared_experts import (
        stand_in_shared_experts,
    )

    stand_in = stand_in_shared_experts(shared_experts_class())
    hidden = torch.zeros(1, 8)
    if APHRODITE_VERSION != "0.20.0":
        with pytest.raises(AttributeError):
            stand_in._determine_shared_experts_order(hidden)
    result = {r.patch.id: r.status.value for r in overlay.apply_all()}["P6"]
    assert result == ("UPSTREAM_FIXED" if APHRODITE_VERSION == "0.20.0" else "APPLIED")
    if result == "APPLIED":
        assert stand_in._determine_shared_experts_order(hidden) == SharedExpertsOrder.NO_OVERLAP
        # the answer is cached on the instance: the hot path asks the module tree once
        assert stand_in.__dict__["_hybrid_exl3_fixes_exl3_shared_expert"] is True


def test_an_unquantized_shared_expert_is_left_to_the_release(overlay):
    overlay.apply_all()
    with pytest.raises(AttributeError):  # the release's own logic runs, and the stand-in lacks its config
        plain_shared_experts()._determine_shared_experts_order(torch.zeros(1, 8))
