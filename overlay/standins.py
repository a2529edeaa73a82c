"""The EXL3 layer probes and stand-ins the LoRA-side patches share (P2, P2b, P5, P6): how to recognise an EXL3
layer and where its tensors live, and stand-in layers shaped as aphrodite's LoRA code sees a loaded EXL3 layer
(the patches' probes ask the live code about them; the tests use them too). Nothing here patches anything."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported lazily: the overlay must import where torch is absent
    import torch

# Placeholders Exl3LinearMethod / Exl3MoEMethod register on the layer (quantization/exl3.py).
EXL3_PLACEHOLDERS = ("trellis", "w2_trellis", "w13_trellis")


def exl3_placeholder(layer: Any) -> Any | None:
    """The EXL3 trellis placeholder of a linear or MoE layer, or None for a non-EXL3 layer (a 0.22+
    FusedMoE keeps its expert weights on ``routed_experts``)."""
    layer = getattr(layer, "routed_experts", layer)
    for name in EXL3_PLACEHOLDERS:
        param = getattr(layer, name, None)
        if param is not None:
            return param
    return None


def exl3_device(layer: Any) -> torch.device | None:
    """Where an EXL3 layer's tensors live; None when the layer is not EXL3."""
    import torch

    param = exl3_placeholder(layer)
    if param is None:
        return None
    for tensor in getattr(param, "exl3_tensors", {}).values():
        return tensor.device
    # Not loaded yet: process_weights_after_loading moves them to the current CUDA device.
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return param.device if isinstance(param, torch.Tensor) else torch.device("cpu")


def _placeholders(layer: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Plain Parameters shaped like ``Exl3Parameter`` (an empty tensor plus an ``exl3_tensors`` dict),
    not the real class, whose constructor asks for the tensor-parallel group: plugins run in workers
    before that group exists."""
    import torch

    for name in names:
        param = torch.nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        param.exl3_tensors = {}
        layer.register_parameter(name, param)


def fake_exl3_layer(device: str = "cpu") -> torch.nn.Module:
    """A loaded EXL3 base layer as the LoRA code sees it: placeholders with one fused shard."""
    import torch

    layer = torch.nn.Module()
    layer.prefix = "language_model.model.layers.0.linear_attn.in_proj_qkv"
    _placeholders(layer, ("suh", "svh", "trellis", "mcg", "mul1"))
    layer.trellis.exl3_tensors[(0, 1, 2)] = torch.empty(1, 1, 16, dtype=torch.int16, device=device)  # device only
    return layer


def fake_exl3_moe_layer(device: str = "cpu", routed_experts: bool = False) -> torch.nn.Module:
    """A loaded EXL3 MoE layer: the expert placeholders Exl3MoEMethod registers (``w13_*``/``w2_*``) on
    the FusedMoE itself, as 0.20/0.21 build it, or (``routed_experts``) on its ``routed_experts``, as
    0.22+ do. The probe asks about the first form: a ``_get_lora_device`` that knows the EXL3 MoE names
    recognises it in every release (0.22+ unwrap ``routed_experts`` first, then look at the same names)."""
    import torch

    layer = torch.nn.Module()
    layer.prefix = "language_model.model.layers.0.mlp.experts"
    holder = layer
    if routed_experts:
        holder = layer.routed_experts = torch.nn.Module()
    _placeholders(
        holder, tuple(f"{w}_{part}" for w in ("w13", "w2") for part in ("suh", "svh", "trellis", "mcg", "mul1"))
    )
    holder.w2_trellis.exl3_tensors[0] = torch.empty(1, 1, 16, dtype=torch.int16, device=device)  # device only
    return layer


def is_unsupported_layer_error(exc: BaseException) -> bool:
    return isinstance(exc, ValueError) and str(exc).startswith("Unsupported base layer")


def exl3_fallback(original, answer):
    """A one-argument wrapper of ``original`` that, where the original rejects a layer with
    "Unsupported base layer", returns ``answer(arg)`` instead when that is not None."""

    def wrapper(arg):
        try:
            return original(arg)
        except ValueError as exc:
            value = answer(arg) if is_unsupported_layer_error(exc) else None
            if value is None:
                raise
            return value

    return wrapper
