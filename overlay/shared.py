"""What the patches share, so that no patch module imports another: the targets two patches replace (a later patch
wraps what an earlier one installed, in the order ``Patch.after`` declares), the EXL3 layer probes and the stand-in
layers the LoRA-side patches ask the live code about (the tests use them too), the EXL3 GEMM launch that P3 and P8
route shards to, and the load-time wrapper the EXL3 patches put around ``process_weights_after_loading``. Nothing
here patches anything."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hybrid_exl3_fixes.decisions import exl3_kernels as kernels
from hybrid_exl3_fixes.registry import Drift, Live, NotApplicable, Target, logger, tag, tags_of

if TYPE_CHECKING:  # torch is imported lazily: the overlay must import where torch is absent
    import torch

# -- the EXL3 layer: how to recognise one, and stand-ins shaped as aphrodite's LoRA code sees a loaded one ---------

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


# -- the EXL3 quantization module's targets and load-time wrappers ---------------------------------------------

MODULE = "aphrodite.model_executor.layers.quantization.exl3"


def source_tree(function, what: str) -> ast.Module:
    """``function``'s source, parsed; ``Drift`` naming ``what`` where it has none readable (a C function, a lambda
    built at run time)."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise Drift(f"{what} has no readable source: {exc}") from exc


def after_loading(patch_id: str, original: Callable, step: Callable, failure: str, name_attr: str) -> Callable:
    """A ``process_weights_after_loading`` that runs ``original``, then ``step(self, layer)``. A failing step is
    logged (``failure`` % the layer's ``name_attr``, with the traceback) and never fails a load that upstream would
    have finished."""

    def process_weights_after_loading(self, layer):
        original(self, layer)
        try:
            step(self, layer)
        except Exception:
            logger.warning(failure, getattr(layer, name_attr, type(layer).__name__), exc_info=True)

    return tag(patch_id, process_weights_after_loading, original)


def builds_after_loading(patch_id: str, target, step: Callable, failure: str, name_attr: str) -> Callable:
    """A patch's ``build``: ``target`` (a ``process_weights_after_loading``) replaced by ``after_loading`` around the
    live function with ``step``."""

    def build(live) -> dict:
        return {target.key: after_loading(patch_id, live[target.key].function, step, failure, name_attr)}

    return build


def time_interleaved(fns: dict, torch, rounds: int, calls: int, warmup: int) -> dict:
    """Median µs per call of each of ``fns`` (key -> no-argument callable): ``warmup`` calls each, then ``rounds``
    rounds of ``calls`` calls between two CUDA events, the callables interleaved and their order reversed every
    round (P8's and P12's load-time measurement)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict = {key: [] for key in fns}
    order = list(fns)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(rounds):
        for key in order if r % 2 == 0 else reversed(order):
            start.record()
            for _ in range(calls):
                fns[key]()
            end.record()
            end.synchronize()
            samples[key].append(start.elapsed_time(end) * 1e3 / calls)
    return {key: sorted(s)[len(s) // 2] for key, s in samples.items()}


MOE_APPLY = Target(
    MODULE,
    "Exl3MoEMethod.apply",
    params=("self", "layer", "x", "topk_weights", "topk_ids", "shared_experts_input"),  # 0.20, 0.21
    also=(("self", "layer", "x", "topk_weights", "topk_ids", "shared_experts", "shared_experts_input"),),  # 0.22+
)

MOE_LOAD = Target(MODULE, "Exl3MoEMethod.process_weights_after_loading", params=("self", "layer"))


PROCESS_WEIGHTS = Target(MODULE, "Exl3LinearMethod.process_weights_after_loading", params=("self", "layer"))


# -- the small-batch EXL3 GEMM: its codebook flags, the table dispatch P3 and P8 probe, the launch they route to ---

CODEBOOK_FLAGS = {"3inst": (False, False), "mcg": (True, False), "mul1": (False, True)}


def table_dispatch_unpatched(live: dict[str, Live], patch_id: str) -> bool:
    """The probe P3 and P8 share: the installed kernel library's dispatch (its dynamic symbols, ~1 ms, no GPU).
    0.20 - 0.23's sample-table cache (codebook-blind) -> True until ``patch_id``'s tag is on the loader (P8 may wrap
    P3's replacement, so the whole wrapper chain is read); 0.24's autotuner -> False; no EXL3 GEMM -> NotApplicable;
    an unknown dispatch -> Drift."""
    verdict, evidence = kernels.classify_build(kernels.installed_kernel_libraries())
    if verdict is None:
        raise NotApplicable(evidence)
    if verdict == kernels.UNKNOWN_DISPATCH:
        raise Drift(evidence)
    if verdict == kernels.CODEBOOK_KEYED:
        return False
    return patch_id not in tags_of(live[PROCESS_WEIGHTS.key].raw)


def codebook_of(layer, shard_id) -> str:
    if shard_id in layer.mcg.exl3_tensors:
        return "mcg"
    if shard_id in layer.mul1.exl3_tensors:
        return "mul1"
    return "3inst"


def shard_operands(layer, shard_id) -> tuple:
    """(trellis, suh, svh, mcg, mul1) of one shard: the operands of an EXL3 GEMM launch."""
    mcg, mul1 = CODEBOOK_FLAGS[codebook_of(layer, shard_id)]
    tensors = (layer.trellis, layer.suh, layer.svh)
    return (*(t.exl3_tensors[shard_id] for t in tensors), mcg, mul1)


def _routed_apply_one(self, layer, x, shard_id):
    route = layer.hxf_exl3_routes.get(shard_id)
    if route is None:
        return type(self)._apply_one(self, layer, x, shard_id)
    return routed_linear()(x, *shard_operands(layer, shard_id), route[0], route[1])


_ROUTED_OP = None


def routed_linear():
    """``hybrid_exl3_fixes::exl3_linear_routed``: aphrodite's _exl3_linear_one, with the <= 32-row
    branch launching exl3_gemm uncached (force_shape_idx > 0) or, for shape_idx 0, taking the
    reconstruct path at every batch size. A custom op so torch.compile and CUDA graphs treat it
    as aphrodite's own."""
    global _ROUTED_OP
    if _ROUTED_OP is not None:
        return _ROUTED_OP
    import torch
    from aphrodite import _custom_ops as ops

    def exl3_linear_routed(x, trellis, suh, svh, mcg, mul1, shape_idx, num_sms):
        out_features = trellis.shape[1] * 16
        output = torch.empty((x.shape[0], out_features), device=x.device, dtype=torch.float16)
        x_had = torch.empty_like(x)
        if shape_idx > 0 and x.shape[0] <= kernels.SMALL_BATCH_ROWS:
            ops.exl3_gemm(x, trellis, output, suh, x_had, svh, shape_idx, mcg, mul1, num_sms)
            return output
        weight = torch.empty((trellis.shape[0] * 16, out_features), device=trellis.device, dtype=torch.float16)
        ops.exl3_reconstruct(weight, trellis, trellis.shape[2] // 16, mcg, mul1)
        ops.exl3_had_r_128(x, x_had, suh, None, 1.0)
        ops.exl3_hgemm(x_had, weight, output)
        ops.exl3_had_r_128(output, output, None, svh, 1.0)
        return output

    op = torch.library.custom_op(
        "hybrid_exl3_fixes::exl3_linear_routed",
        exl3_linear_routed,
        mutates_args=(),
        device_types="cuda",
        schema="(Tensor x, Tensor trellis, Tensor suh, Tensor svh, bool mcg, bool mul1, int shape_idx, "
        "int num_sms) -> Tensor",
    )

    @op.register_fake
    def _(x, trellis, suh, svh, mcg, mul1, shape_idx, num_sms):
        return x.new_empty((x.shape[0], trellis.shape[1] * 16), dtype=torch.float16)

    _ROUTED_OP = op
    return op


# -- EXL3 MoE facts two patches read -----------------------------------------------------------------------------

ROUTER_MODULE = "aphrodite.model_executor.layers.fused_moe.router.fused_topk_router"


def marks_padding_rows() -> bool:
    """Whether this release's fused top-k routers give padding rows expert id -1 (0.23+: ``_get_padding_mask``
    feeds ``is_padding`` to the top-k kernel, gated by ``APHRODITE_MOE_SKIP_PADDING``)."""
    import importlib

    try:
        router = importlib.import_module(ROUTER_MODULE)
    except ImportError:  # 0.20, 0.21: no router package
        return False
    return callable(getattr(router, "_get_padding_mask", None))


# ``self.moe_kernel = ...`` (or any ``<x>.moe_kernel = ...``): how a quant method hands FusedMoEWithLoRA its kernel
ASSIGNS_KERNEL = re.compile(r"\.moe_kernel\s*=(?!=)")


def exl3_moe_method_has_no_lora_kernel() -> bool:
    from aphrodite.model_executor.layers.quantization import exl3

    method = getattr(exl3, "Exl3MoEMethod", None)
    if method is None:
        raise NotApplicable("this aphrodite has no EXL3 MoE method")
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):  # no source shipped: cannot tell, assume the kernel is still missing
        source = ""
    return "select_gemm_impl" not in vars(method) and not ASSIGNS_KERNEL.search(source)
