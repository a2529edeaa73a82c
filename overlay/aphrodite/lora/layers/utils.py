"""P2: ``_get_lora_device`` recognises EXL3 base layers, at every site that bound it by name.

Why:     ``_get_lora_device`` knows ``weight``, ``weight_packed``, ``qweight`` and the MoE
         ``w2_*`` names, not EXL3 (``suh``/``svh``/``trellis``/``mcg``/``mul1``). With P1 in
         place, EXL3 + LoRA stops at
         ``ValueError: Unsupported base layer: MergedColumnParallelLinear(in_features=256, ...)``
         (seen on an H200 with aphrodite-engine 0.21.0; present in 0.20.0 too).
How:     Wrap the original: when it raises for a layer that carries EXL3 tensors (``trellis``, or
         ``w2_trellis``/``w13_trellis`` for EXL3 MoE), answer the device those tensors live on
         once loaded (``Exl3Parameter.exl3_tensors``), else the current CUDA device. The function
         is imported by name into ``lora/layers/base_linear.py`` and ``lora/layers/fused_moe.py``;
         replacing it in ``utils`` alone changes nothing at those call sites, so all three are
         targets, and any other aphrodite module still holding the original is replaced too.
         The probe asks about both kinds of EXL3 layer, a dense one (``trellis``) and a MoE one
         (``w13_trellis``/``w2_trellis``, on the FusedMoE itself in 0.20/0.21 and on its
         ``routed_experts`` from 0.22), and reports the bug while either is rejected.
Upstream: https://github.com/dphnAI/sonar/pull/1712, first released in aphrodite-engine 0.22.0, fixed
         dense EXL3 layers only (it answers the current device without looking at the tensors);
         EXL3 MoE layers are still rejected in 0.22.0 - 0.24.1, so P2 applies there too, for them
         (docs/upstream/exl3-moe-lora-device.md; the MoE branch of patches/0002).
Retire when: an aphrodite release recognises EXL3 MoE layers too (the probe then reports
         UPSTREAM_FIXED) and is the oldest supported one.
"""

from __future__ import annotations

from typing import Any

from hybrid_exl3_fixes.registry import Drift, Live, Patch, Target, tag
from hybrid_exl3_fixes.shared import (
    exl3_device,
    exl3_fallback,
    fake_exl3_layer,
    fake_exl3_moe_layer,
    is_unsupported_layer_error,
)

UTILS = Target("aphrodite.lora.layers.utils", "_get_lora_device", params=("base_layer",))
BINDING_SITES = (
    Target("aphrodite.lora.layers.base_linear", "_get_lora_device", binds=UTILS.key),
    Target("aphrodite.lora.layers.fused_moe", "_get_lora_device", binds=UTILS.key),
)


def rejects(function, layer) -> bool:
    """Whether ``_get_lora_device`` rejects this layer. Any other outcome means it was recognised:
    0.22+ answers the current accelerator, which raises "no accelerator" on a CPU-only machine."""
    try:
        function(layer)
        return False
    except Exception as exc:  # noqa: BLE001 - classified here
        return is_unsupported_layer_error(exc)


def probe_lora_device_for_exl3(live: dict[str, Live]) -> bool:
    """True when the live ``_get_lora_device`` (at every binding site) rejects a dense EXL3 layer or
    an EXL3 MoE layer (either form)."""
    layers = (fake_exl3_layer(), fake_exl3_moe_layer())
    answers = {key: any(rejects(item.value, layer) for layer in layers) for key, item in live.items()}
    if len(set(answers.values())) > 1:
        raise Drift(f"binding sites disagree about EXL3 layers: {answers}")
    return next(iter(answers.values()))


def build(live: dict[str, Live]) -> dict[str, Any]:
    original = live[UTILS.key].function
    return {UTILS.key: tag("P2", exl3_fallback(original, exl3_device), original)}


PATCH = Patch(
    id="P2",
    slug="lora-device-exl3",
    title="LoRA device for EXL3 base layers (utils, base_linear, fused_moe)",
    upstream="https://github.com/dphnAI/sonar/pull/1712",
    fixed_in=None,  # 0.22.0 fixed dense EXL3 layers only (#1712); MoE layers are still rejected in 0.24.1
    retire_when="an aphrodite release recognises EXL3 MoE layers for LoRA and is the oldest supported one",
    targets=(UTILS, *BINDING_SITES),
    probe=probe_lora_device_for_exl3,
    build=build,
    scan_stale_copies_of=(UTILS.key,),
    symptom="then `Unsupported base layer: MergedColumnParallelLinear` (dense) or `... RoutedExperts` (MoE): "
    "LoRA finds no device for EXL3 layers",
)
