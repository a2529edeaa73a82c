"""P6: an EXL3 shared expert stays on the main CUDA stream, beside the EXL3 routed experts.

Why:     For a batch of at most ``APHRODITE_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD`` tokens (256), 0.21+
         ``SharedExperts._determine_shared_experts_order`` runs the shared expert on an auxiliary CUDA
         stream (MULTI_STREAM_OVERLAPPED), concurrently with the routed experts. With EXL3 both sides
         are EXL3 GEMMs (the shared expert's ``exl3_gemm``, the routed experts' ``exl3_mgemm``/``exl3_moe``),
         cooperative kernels that order their split-K partial sums through one lock array per device
         (``DevCtx::get_locks``, ``barrier_acquire(&locks[slice_m * blocks_n + slice2_n], ...)`` in
         csrc/quantization/exl3/exllamav3_ext/quant/exl3_gemm_inner.cuh, v0.21.0): two of them at once
         on two streams spin on, and reset, the same counters. 0.20.0 kept EXL3 off the aux stream:
         ``Exl3MoEMethod.supports_shared_expert_overlap`` is False and 0.20's
         ``_determine_shared_experts_order`` returned NO_OVERLAP for such a method (and while compiling
         or capturing). 0.21.0 (the upstream sync dphnAI/sonar@18f852d0b) dropped that check and the base
         property; ``Exl3MoEMethod`` still declares False, and nothing reads it (0.21.0 - 0.24.1).
         Without P6 an EXL3 MoE server can stop answering, intermittently; with it the shared expert and
         the routed experts never spin on those counters at once (measurements:
         docs/upstream/exl3-moe-shared-expert-stream.md).
How:     Wrap ``_determine_shared_experts_order``: when the shared expert module holds EXL3 layers
         (answer cached on the instance), return NO_OVERLAP; otherwise defer to the original. The
         shared expert then runs on the main stream, in order with the routed experts, as on 0.20.
Probe:   asked about a stand-in whose shared expert is EXL3, the live ``_determine_shared_experts_order``
         does not answer NO_OVERLAP from that alone, and its code can choose MULTI_STREAM_OVERLAPPED
         without reading the quant method's ``supports_shared_expert_overlap`` (Exl3MoEMethod declares
         it False). 0.20.0 reads it: UPSTREAM_FIXED there.
Upstream: not reported yet; the upstream-ready diff is patches/0006-exl3-moe-shared-expert-stream.patch.
Retire when: an aphrodite release keeps EXL3 shared experts off the aux stream (or gives EXL3 kernels a
         lock array per stream) and is the oldest supported one.
"""

from __future__ import annotations

from typing import Any

from hybrid_exl3_fixes.registry import Live, NotApplicable, Patch, Target, tag
from hybrid_exl3_fixes.shared import exl3_placeholder, fake_exl3_layer

MODULE = "aphrodite.model_executor.layers.fused_moe.runner.shared_experts"
ORDER = Target(MODULE, "SharedExperts._determine_shared_experts_order", params=("self", "hidden_states"))
FLAG = "_hybrid_exl3_fixes_exl3_shared_expert"  # cached on each SharedExperts: is its module EXL3?


def no_overlap_order() -> Any:
    import importlib

    return importlib.import_module(MODULE).SharedExpertsOrder.NO_OVERLAP


def stand_in_shared_experts(cls: type) -> Any:
    """A SharedExperts never initialised by its own constructor, whose shared expert is an EXL3 MLP (one
    loaded EXL3 linear); it lacks everything else, so code that goes past the EXL3 question raises."""
    import torch

    shared = object.__new__(cls)
    expert = torch.nn.Module()
    expert.down_proj = fake_exl3_layer()
    shared.__dict__["_layer"] = expert
    return shared


def probe_shared_expert_stream(live: dict[str, Live]) -> bool:
    """True when the live order function may put an EXL3 shared expert on the aux stream: asked about a
    stand-in with an EXL3 shared expert it does not answer NO_OVERLAP by itself, and its code can choose
    MULTI_STREAM_OVERLAPPED without reading the quant method's ``supports_shared_expert_overlap``
    (which Exl3MoEMethod declares False)."""
    from aphrodite.model_executor.layers.quantization import exl3

    if getattr(exl3, "Exl3MoEMethod", None) is None:
        raise NotApplicable("this aphrodite has no EXL3 MoE method")
    function = live[ORDER.key].function
    no_overlap = no_overlap_order()
    try:
        if function(stand_in_shared_experts(live[ORDER.key].owner), None) == no_overlap:
            return False
    except (AttributeError, TypeError):  # it went on to the parallel config, the stream, the platform
        pass
    code = function.__code__
    if "MULTI_STREAM_OVERLAPPED" not in code.co_names:
        raise NotApplicable("SharedExperts never chooses the auxiliary stream here")
    # read as an attribute (0.20.0) or by getattr with a default (patches/0006)
    return "supports_shared_expert_overlap" not in (*code.co_names, *code.co_consts)


def is_exl3(module: Any) -> bool:
    return any(exl3_placeholder(m) is not None for m in module.modules())


def build(live: dict[str, Live]) -> dict[str, Any]:
    original = live[ORDER.key].function
    no_overlap = no_overlap_order()

    def _determine_shared_experts_order(self, hidden_states):
        exl3_shared = self.__dict__.get(FLAG)
        if exl3_shared is None:
            exl3_shared = self.__dict__[FLAG] = is_exl3(self._layer)
        if exl3_shared:
            return no_overlap
        return original(self, hidden_states)

    return {ORDER.key: tag("P6", _determine_shared_experts_order, original)}


PATCH = Patch(
    id="P6",
    slug="exl3-moe-shared-expert-stream",
    title="EXL3 shared expert kept on the main stream (EXL3 kernels share one lock array)",
    upstream="not reported yet (patches/0006-exl3-moe-shared-expert-stream.patch)",
    fixed_in=None,
    retire_when="an aphrodite release keeps EXL3 shared experts off the aux stream and is the oldest supported one",
    targets=(ORDER,),
    probe=probe_shared_expert_stream,
    build=build,
    symptom="an EXL3 MoE server stops answering (its shared expert on a second stream)",
)
