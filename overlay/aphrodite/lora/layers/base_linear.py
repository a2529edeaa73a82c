"""P2b: the LoRA linear wrapper's ``weight`` property answers for EXL3 base layers.

Why:     ``BaseLinearLayerWithLoRA.weight`` returns ``weight``, ``weight_packed``, ``qweight``
         or marlin's ``B`` and raises ``ValueError: Unsupported base layer`` for anything else,
         EXL3 included. Nothing on the Qwen3.5 load path reads it in 0.21 (latent), but any
         model or tool that asks a LoRA-wrapped EXL3 projection for ``.weight`` (dtype, device,
         shape checks) crashes. Read from the 0.20.0, 0.21.0 and 0.24.1 wheels: still there in 0.24.1.
How:     Wrap the property: when the original raises for a layer with EXL3 tensors, return the
         layer's registered ``trellis`` placeholder parameter (the EXL3 counterpart of GPTQ's
         ``qweight``; it lives on the model's device and holds the shards in ``exl3_tensors``).
Upstream: not reported yet; the upstream-ready diff is patches/0002b-lora-weight-exl3.patch.
Retire when: an aphrodite release gives ``BaseLinearLayerWithLoRA.weight`` an EXL3 branch (the
         probe then reports UPSTREAM_FIXED).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hybrid_exl3_fixes.registry import Live, Patch, Target, tag
from hybrid_exl3_fixes.shared import exl3_fallback, exl3_placeholder, fake_exl3_layer, is_unsupported_layer_error

WEIGHT = Target("aphrodite.lora.layers.base_linear", "BaseLinearLayerWithLoRA.weight")


def probe_lora_weight_for_exl3(live: dict[str, Live]) -> bool:
    """True when the live ``weight`` property rejects a LoRA-wrapped EXL3 layer."""
    fget = live[WEIGHT.key].function
    try:
        fget(SimpleNamespace(base_layer=fake_exl3_layer()))
    except ValueError as exc:
        if is_unsupported_layer_error(exc):
            return True
        raise
    return False


def build(live: dict[str, Live]) -> dict[str, Any]:
    original = live[WEIGHT.key].function
    weight = exl3_fallback(original, lambda wrapper: exl3_placeholder(wrapper.base_layer))
    return {WEIGHT.key: property(tag("P2b", weight, original))}


PATCH = Patch(
    id="P2b",
    slug="lora-weight-exl3",
    title="LoRA wrapper .weight for EXL3 base layers (latent)",
    upstream="not reported yet (patches/0002b-lora-weight-exl3.patch)",
    fixed_in=None,
    retire_when="an aphrodite release gives BaseLinearLayerWithLoRA.weight an EXL3 branch",
    targets=(WEIGHT,),
    probe=probe_lora_weight_for_exl3,
    build=build,
    symptom="LoRA's `weight` property fails on EXL3 layers (latent)",
)
