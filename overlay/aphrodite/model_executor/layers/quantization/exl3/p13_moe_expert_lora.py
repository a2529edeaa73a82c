"""P13: LoRA on the routed experts of EXL3 MoE layers: a LoRA-capable modular kernel for ``Exl3MoEMethod`` (0.21+).

Target: ``aphrodite/model_executor/layers/quantization/exl3.py``.

Why:     ``FusedMoEWithLoRA`` computes a MoE layer's experts with LoRA through the quant method's modular kernel
         (``quant_method.moe_kernel``, whose experts class mixes in ``LoRAExpertsMixin``); ``Exl3MoEMethod`` has none:
         its ``exl3_moe`` kernel fuses gate/up, the activation and down, so no expert delta can be added between them.
         Without the overlay an EXL3 MoE hybrid with ``--enable-lora`` stops at start-up; with P5 it serves every
         adapter but those on the routed experts, which P5 refuses by name (docs/upstream/exl3-moe-lora-device.md).
How:     after the original ``process_weights_after_loading``, when LoRA is on (``moe.is_lora_enabled``), the method
         gets ``moe_kernel``: no DP/EP prepare and finalize and ``Exl3LoRAExperts`` (hybrid_exl3_fixes.exl3.moe_lora):
         the fused kernel for batches without LoRA, else gate/up per (token, expert) assignment from the EXL3
         kernels, aphrodite's ``apply_w13_lora``, the activation, down with the routed weights, ``apply_w2_lora``.
         ``FusedMoEWithLoRA`` then wraps the layer as it wraps any LoRA-capable MoE, and aphrodite's adapter loading
         stacks the adapter into its buffers: PEFT's ``target_parameters`` form on fused experts for Qwen3.5/3.6
         (``is_3d_moe_weight``), per-expert modules with ``--enable-mixed-moe-lora-format`` (0.24+). P5 leaves a
         layer with such a kernel to the wrapper, stops refusing expert adapters for it, and refuses the
         per-expert form where the model takes the fused one, naming the flag.
         On 0.21.0 the LoRA manager's walk over ``named_modules`` goes on into the wrapped MoE layer's own children
         (its ``runner``, which holds the router ``gate`` and the shared experts as aliases of the block's modules)
         and stops at ``get_submodule``: "FusedMoE3DWithLoRA has no attribute `runner`" (0.22+ resolve the alias
         themselves). P13 gives ``replace_submodule`` (both binding sites) the one step it lacks there: a parent
         path that runs through a LoRA wrapper is resolved through the wrapper's ``base_layer``, so the alias is
         wrapped as it was while the MoE layer stayed unwrapped (docs/upstream/lora-moe-runner-alias.md).
         On 0.20 - 0.21 the MoE-LoRA align kernel every wrapped MoE layer uses skips the last adapter slot of a batch
         with base-model tokens; P14 fixes it there (docs/upstream/moe-lora-align-grid.md).
Probe:   an opt-in (``HYBRID_EXL3_FIXES_MOE_EXPERT_LORA=1``), experimental: against HF + PEFT on a GPU it is right for
         one request at a time and wrong in batches that mix requests (docs/drafts/p13-moe-expert-lora.md);
         NOT_APPLICABLE without ``LoRAExpertsMixin`` (0.20) or where ``FusedMoEWithLoRA`` does not take the quant
         method's ``moe_kernel`` (checked in its source); buggy while ``Exl3MoEMethod`` gives itself no kernel.
Upstream: not reported yet; the design and its sources are docs/drafts/p13-moe-expert-lora.md.
Retire when: an aphrodite release gives EXL3 MoE a LoRA-capable kernel and is the oldest supported one.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from hybrid_exl3_fixes.aphrodite.lora.layers.fused_moe import exl3_moe_method_has_no_lora_kernel
from hybrid_exl3_fixes.exl3 import moe_lora
from hybrid_exl3_fixes.registry import Drift, NotApplicable, Patch, Registry, Target, tag

from .common import builds_after_loading
from .p10_moe_context import MOE_LOAD

LORA_WRAPPER = "aphrodite.lora.layers.fused_moe"
REPLACE = Target("aphrodite.lora.utils", "replace_submodule", params=("model", "module_name", "new_module"))
REPLACE_MANAGER = Target("aphrodite.lora.model_manager", "replace_submodule", binds=REPLACE.key)


def probe_moe_expert_lora(live) -> bool:
    """True = the EXL3 MoE method has no LoRA-capable kernel and P13 is not in place."""
    if not moe_lora.enabled(os.environ):
        raise NotApplicable(
            "an experimental opt-in (not yet correct in batches that mix requests): set "
            f"{moe_lora.ENABLE_ENV}=1 to serve adapters on the routed experts of EXL3 MoE layers (without it P5 "
            "refuses them by name)"
        )
    if moe_lora.lora_experts_mixin() is None:
        raise NotApplicable("this release has no LoRAExpertsMixin, which the MoE LoRA kernels need (0.21+)")
    import importlib

    wrapper = getattr(importlib.import_module(LORA_WRAPPER), "FusedMoEWithLoRA", None)
    try:
        source = inspect.getsource(wrapper.__init__)
    except (AttributeError, OSError, TypeError) as exc:
        raise Drift(f"{LORA_WRAPPER}.FusedMoEWithLoRA.__init__ has no readable source: {exc}") from exc
    if "supports_internal_mk" not in source or "moe_kernel" not in source:
        raise Drift("FusedMoEWithLoRA no longer takes the quant method's moe_kernel (supports_internal_mk)")
    try:
        experts = moe_lora.experts_class()
    except (ImportError, AttributeError, NotImplementedError) as exc:
        raise Drift(f"the EXL3 LoRA experts cannot be built on this release: {exc}") from exc
    if getattr(experts, "__abstractmethods__", None):
        raise Drift(f"the EXL3 LoRA experts miss {sorted(experts.__abstractmethods__)} of this release's interface")
    return exl3_moe_method_has_no_lora_kernel() and "P13" not in Registry._tags(live[MOE_LOAD.key].raw)


def give_lora_kernel(method: Any, layer: Any) -> None:
    """With LoRA on, the method's ``moe_kernel`` for ``FusedMoEWithLoRA`` (nothing changes with LoRA off)."""
    if getattr(method.moe, "is_lora_enabled", False) and method.moe_kernel is None:
        method.moe_kernel = moe_lora.make_kernel(method, layer)


def through_lora_wrappers(model: Any, path: str) -> Any | None:
    """The module at ``path``, stepping into a LoRA wrapper's ``base_layer`` where the wrapper lacks the next name;
    None where no such step finds it."""
    from aphrodite.lora.layers import BaseLayerWithLoRA

    module = model
    for name in path.split(".") if path else ():
        found = getattr(module, name, None) if hasattr(module, name) else None
        while found is None and isinstance(module, BaseLayerWithLoRA) and hasattr(module, "base_layer"):
            module = module.base_layer
            found = getattr(module, name, None) if hasattr(module, name) else None
        if found is None:
            return None
        module = found
    return module


def build_replace_submodule(original):
    """``replace_submodule`` that resolves a parent path through LoRA wrappers where the original cannot."""

    def replace_submodule(model, module_name, new_module):
        parent_name, _, name = module_name.rpartition(".")
        try:
            model.get_submodule(parent_name)
        except AttributeError:
            parent = through_lora_wrappers(model, parent_name)
            if parent is None:
                raise
            setattr(parent, name, new_module)
            return new_module
        return original(model, module_name, new_module)

    return tag("P13", replace_submodule, original)


give_kernel = builds_after_loading(
    "P13",
    MOE_LOAD,
    give_lora_kernel,
    "hybrid-exl3-fixes: P13 could not give the EXL3 MoE layer %s a LoRA kernel; adapters on its routed experts are "
    "refused (P5)",
    "layer_name",
)


def build(live) -> dict:
    return {**give_kernel(live), REPLACE.key: build_replace_submodule(live[REPLACE.key].function)}


PATCH_P13 = Patch(
    id="P13",
    slug="exl3-moe-expert-lora",
    title="EXL3 MoE + LoRA on the routed experts: a LoRA-capable modular kernel (the decomposed expert MLP with "
    "aphrodite's MoE-LoRA kernels), an experimental opt-in: not yet correct in batches that mix requests",
    upstream="docs/drafts/p13-moe-expert-lora.md (not reported upstream)",
    fixed_in=None,
    retire_when="an aphrodite release gives EXL3 MoE a LoRA-capable kernel and is the oldest supported one",
    targets=(MOE_LOAD, REPLACE, REPLACE_MANAGER),
    probe=probe_moe_expert_lora,
    build=build,
    checks_tag_after_apply=True,
)
