"""P5: EXL3 MoE layers with LoRA on: leave the routed experts unwrapped; refuse expert adapters by name.

Why:     With ``--enable-lora`` the LoRA model manager wraps every FusedMoE (0.20/0.21) or MoERunner
         (0.22+) in ``FusedMoEWithLoRA``, whose constructor needs a modular kernel that can take
         LoRA. ``Exl3MoEMethod`` has none (it never sets ``moe_kernel`` and runs its own
         per-expert ``exl3_mgemm`` calls), so an EXL3 MoE hybrid (Qwen3.5/3.6-35B-A3B) fails at
         start-up, whatever the adapters target: in 0.20/0.21
         ``ValueError: ... uses the new modular kernel initialization logic. This function should
         not be called.`` from ``select_gemm_impl`` (lora/layers/fused_moe.py:55 in 0.21.0), in
         0.22-0.24.1 ``RuntimeError: Old-style modular kernel not supported.`` (0.24.1: line 70),
         each behind ``_get_lora_device``'s own rejection of EXL3 MoE layers (P2). Read from the
         six wheels; the first error is what an H200 run shows (docs/gpu-runs/2026-12-01-run11/README.md).
How:     ``FusedMoEWithLoRA.can_replace_layer`` and ``FusedMoE3DWithLoRA.can_replace_layer``
         decline a MoE layer that carries EXL3 expert tensors. The manager then keeps the EXL3
         layer as it is and logs that it "could not be wrapped by any LoRA layer implementation
         ... It will be ignored" (present in every release 0.20.0 - 0.24.1), so adapters on the
         attention, GatedDeltaNet and shared-expert projections (ordinary EXL3 linears: P1, P2)
         serve. An adapter that also carries routed-expert weights would have them dropped
         silently, a wrong answer, so ``WorkerLoRAManager._load_adapter`` refuses it before
         anything is registered: ``ValueError`` naming the modules, which the server answers as
         an error response to ``/v1/load_lora_adapter`` (or a start-up error for
         ``--lora-modules``) while the engine keeps running. A layer whose quant method offers a
         LoRA-capable ``moe_kernel`` (P13's, opted in) is left to the wrapper, and adapters are
         refused only while some EXL3 MoE layer stays unwrapped. With every layer wrapped, a model whose
         MoE LoRA wrappers take the fused form (``_is_3d_moe_model``: Qwen3.5/3.6) refuses an adapter in
         PEFT's per-expert form, naming the fused form and ``--enable-mixed-moe-lora-format`` (0.24+),
         before aphrodite's own module check would refuse it less clearly.
Probe:   the live ``can_replace_layer`` accepts a stand-in EXL3 MoE layer (an uninitialised
         FusedMoE/MoERunner instance with the ``w13_*``/``w2_*`` placeholders, on the layer or on
         its ``routed_experts``) and ``Exl3MoEMethod`` offers ``FusedMoEWithLoRA`` no kernel: it
         neither overrides ``select_gemm_impl`` nor assigns a modular kernel (``moe_kernel``)
         anywhere in its class. An upstream release that gives EXL3 experts a LoRA-capable
         kernel, or declines them itself, reports UPSTREAM_FIXED.
Upstream: not reported yet; the upstream-ready diff is patches/0005-exl3-moe-lora-device.patch and the
         write-up docs/upstream/exl3-moe-lora-device.md.
Retire when: an aphrodite release applies LoRA to EXL3 experts (or declines them) and is the
         oldest supported one.
"""

from __future__ import annotations

import re
from typing import Any

from hybrid_exl3_fixes.registry import Live, NotApplicable, Patch, Target, tag
from hybrid_exl3_fixes.shared import exl3_moe_method_has_no_lora_kernel, exl3_placeholder, fake_exl3_moe_layer

MODULE = "aphrodite.lora.layers.fused_moe"
CAN_REPLACE = ("cls", "source_layer", "lora_config", "packed_modules_list", "model_config")
WRAPPER_2D = Target(MODULE, "FusedMoEWithLoRA.can_replace_layer", params=CAN_REPLACE)
WRAPPER_3D = Target(MODULE, "FusedMoE3DWithLoRA.can_replace_layer", params=CAN_REPLACE)
LOAD = Target("aphrodite.lora.worker_manager", "WorkerLoRAManager._load_adapter", params=("self", "lora_request"))
# what each wrapper's can_replace_layer asks of the packed module list (two slices, or one fused)
PACKED = {WRAPPER_2D.key: ["w1", "w3"], WRAPPER_3D.key: ["w13"]}
MANAGER_FLAG = "_hybrid_exl3_fixes_exl3_moe"  # cached on the adapter manager: its EXL3 MoE layers, unwrapped/wrapped


def moe_layer_class() -> type:
    """The class ``can_replace_layer`` checks for: MoERunner from 0.22, FusedMoE before."""
    import importlib

    module = importlib.import_module(MODULE)
    cls = getattr(module, "MoERunner", None) or getattr(module, "FusedMoE", None)
    if cls is None:
        raise NotApplicable(f"{MODULE} names neither MoERunner nor FusedMoE")
    oot = getattr(module, "maybe_get_oot_by_class", None)
    return oot(cls) if oot is not None else cls


def stand_in_exl3_moe_layer() -> Any:
    """An instance of the live MoE layer class, never initialised by its own constructor (which asks
    for the parallel config), carrying the EXL3 placeholders as Exl3MoEMethod registers them: on the
    layer (0.20/0.21) and on ``routed_experts`` (0.22+)."""
    import torch

    layer = object.__new__(moe_layer_class())
    torch.nn.Module.__init__(layer)
    source = fake_exl3_moe_layer()
    for name, param in source.named_parameters(recurse=False):
        layer.register_parameter(name, param)
    layer.routed_experts = fake_exl3_moe_layer(routed_experts=True).routed_experts
    layer.prefix = source.prefix
    return layer


def probe_exl3_moe_lora(live: dict[str, Live]) -> bool:
    """True when the live LoRA code would wrap an EXL3 MoE layer that has no LoRA-capable kernel."""
    layer = stand_in_exl3_moe_layer()
    wraps = any(live[key].value(layer, None, packed) for key, packed in PACKED.items())
    return wraps and exl3_moe_method_has_no_lora_kernel()


def has_lora_kernel(layer: Any) -> bool:
    """Whether the layer's quant method offers ``FusedMoEWithLoRA`` a kernel that takes LoRA (P13's, or a later
    release's own), on the layer (0.20/0.21) or its ``routed_experts`` (0.22+)."""
    method = getattr(getattr(layer, "routed_experts", layer), "quant_method", None)
    kernel = getattr(method, "moe_kernel", None)
    try:
        return kernel is not None and bool(kernel.supports_lora())
    except Exception:  # noqa: BLE001 - a kernel that cannot say is not one to hand LoRA to
        return False


def exl3_moe_names(model: Any, wrapped: bool = False) -> list[str]:
    """The model's MoE modules whose experts are EXL3 (FusedMoE or MoERunner) that no LoRA wrapper took, or with
    ``wrapped`` those a wrapper took (each is then its wrapper's ``base_layer``)."""
    cls = moe_layer_class()
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, cls) and exl3_placeholder(module) is not None and name.endswith("base_layer") == wrapped
    ]


def expert_modules(names) -> list[str]:
    """The adapter modules that address routed experts: a path component ``experts`` (per-expert keys
    ``...mlp.experts.3.gate_proj`` or the fused ``...mlp.experts``; ``shared_expert`` is not one)."""
    return sorted({n for n in names if "experts" in n.split(".")})


def per_expert_modules(names) -> list[str]:
    """The adapter modules in PEFT's per-expert form (``...mlp.experts.3.gate_proj``), not the fused one."""
    return sorted({n for n in names if re.search(r"(^|\.)experts\.\d+(\.|$)", n)})


def named(lora_request: Any, modules: list[str], limit: int) -> tuple[str, str]:
    """The adapter and its first ``limit`` modules, as P5's refusals name them."""
    shown = ", ".join(modules[:limit]) + (f", ... ({len(modules)} modules)" if len(modules) > limit else "")
    return (
        f"LoRA adapter {getattr(lora_request, 'lora_name', '?')!r} ({getattr(lora_request, 'lora_path', '?')})",
        shown,
    )


def form_refusal(lora_request: Any, modules: list[str]) -> str:
    adapter, shown = named(lora_request, modules, 3)
    return (
        f"{adapter} holds the routed experts in PEFT's per-expert form: {shown}. This model's MoE LoRA wrappers "
        "take the fused form that PEFT writes for transformers' fused experts "
        "(target_parameters=['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']); aphrodite 0.24+ also takes "
        "per-expert keys with --enable-mixed-moe-lora-format. "
        "The adapter is refused, nothing was loaded. [hybrid-exl3-fixes P5]"
    )


def adapter_file_modules(lora_path: str) -> list[str]:
    """The module names in a local adapter's ``adapter_model.safetensors``, from its header alone (PEFT
    keys without ``base_model.model.`` and the ``.lora_A.weight``-style tail); [] when there is none."""
    import os

    path = os.path.join(os.path.expanduser(str(lora_path)), "adapter_model.safetensors")
    if not os.path.isfile(path):
        return []
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            keys = list(f.keys())
    except Exception:  # noqa: BLE001 - an unreadable file is aphrodite's loader's to report, in its own words
        return []
    return [k.removeprefix("base_model.model.").split(".lora_", 1)[0] for k in keys]


def refusal(lora_request: Any, modules: list[str], layers: int) -> str:
    adapter, shown = named(lora_request, modules, 6)
    return (
        f"{adapter} targets the routed experts of EXL3 MoE layers ({layers} in this model): {shown}. Aphrodite's "
        "EXL3 MoE method has no LoRA kernel, so these weights cannot be applied; the adapter is refused, nothing was "
        "loaded. Adapters on the attention, GatedDeltaNet and shared-expert projections are served: train "
        "without the routed experts (leave mlp.experts out of PEFT's target_modules), or, on aphrodite 0.21+, "
        "try the overlay's experimental P13 (HYBRID_EXL3_FIXES_MOE_EXPERT_LORA=1; not yet correct in batches that mix "
        "requests). "
        "[hybrid-exl3-fixes P5]"
    )


def build(live: dict[str, Live]) -> dict[str, Any]:
    new: dict[str, Any] = {}
    for key in PACKED:
        original = live[key].function

        def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None, _o=original):
            if exl3_placeholder(source_layer) is not None and not has_lora_kernel(source_layer):
                return False
            return _o(cls, source_layer, lora_config, packed_modules_list, model_config)

        new[key] = classmethod(tag("P5", can_replace_layer, original))

    original_load = live[LOAD.key].function

    def _load_adapter(self, lora_request):
        manager = self._adapter_manager
        counts = getattr(manager, MANAGER_FLAG, None)
        if counts is None:  # EXL3 MoE layers left unwrapped, and wrapped (P13's LoRA kernel)
            counts = (len(exl3_moe_names(manager.model)), len(exl3_moe_names(manager.model, wrapped=True)))
            setattr(manager, MANAGER_FLAG, counts)
        layers, wrapped = counts
        # a local safetensors adapter is judged by its header, before anything is read; any other
        # (a hub id, .bin, tensorizer) by what aphrodite's own loader made of it
        names = adapter_file_modules(lora_request.lora_path)
        if layers and (modules := expert_modules(names)):
            raise ValueError(refusal(lora_request, modules, layers))
        fused_only = not getattr(getattr(manager, "lora_config", None), "enable_mixed_moe_lora_format", False)
        if wrapped and fused_only and getattr(manager, "_is_3d_moe_model", False):
            if modules := per_expert_modules(names):
                raise ValueError(form_refusal(lora_request, modules))
        lora = original_load(self, lora_request)
        if layers and (modules := expert_modules(getattr(lora, "loras", {}))):
            raise ValueError(refusal(lora_request, modules, layers))
        return lora

    new[LOAD.key] = tag("P5", _load_adapter, original_load)
    return new


PATCH = Patch(
    id="P5",
    slug="exl3-moe-lora-device",
    title="EXL3 MoE + LoRA: experts left unwrapped, expert adapters refused by name",
    upstream="not reported yet (patches/0005-exl3-moe-lora-device.patch)",
    fixed_in=None,
    retire_when="an aphrodite release applies LoRA to EXL3 experts (or declines them) and is the oldest supported one",
    targets=(WRAPPER_2D, WRAPPER_3D, LOAD),
    probe=probe_exl3_moe_lora,
    build=build,
    symptom="EXL3 MoE with `--enable-lora` stops at start-up (`uses the new modular kernel initialization "
    "logic`); expert adapters are refused by name",
)
