"""P13: LoRA on the routed experts of EXL3 MoE layers: a LoRA-capable modular kernel for ``Exl3MoEMethod`` (0.21+).

Target: ``aphrodite/model_executor/layers/quantization/exl3.py``.

Why:     ``FusedMoEWithLoRA`` computes a MoE layer's experts with LoRA through the quant method's modular kernel
         (``quant_method.moe_kernel``, whose experts class mixes in ``LoRAExpertsMixin``); ``Exl3MoEMethod`` has none:
         its ``exl3_moe`` kernel fuses gate/up, the activation and down, so no expert delta can be added between them.
         Without the overlay an EXL3 MoE hybrid with ``--enable-lora`` stops at start-up; with P5 it serves every
         adapter but those on the routed experts, which P5 refuses by name (docs/upstream/exl3-moe-lora-device.md).
How:     after the original ``process_weights_after_loading``, when LoRA is on (``moe.is_lora_enabled``), the method
         gets ``moe_kernel``: no DP/EP prepare and finalize and ``Exl3LoRAExperts`` (below):
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

The experts (``Exl3LoRAExperts``): the experts' MLP taken apart so that aphrodite's own MoE-LoRA kernels can add each
expert's delta after gate/up (before the activation) and after down.

aphrodite wraps a MoE layer for LoRA in ``FusedMoEWithLoRA``, which needs the quant method's modular kernel to
compute the experts with a ``MoELoRAContext``; ``Exl3MoEMethod`` has none, its fused ``exl3_moe`` kernel runs gate,
up, activation and down in one launch (docs/upstream/exl3-moe-lora-device.md). ``Exl3LoRAExperts`` is that kernel's
experts part for EXL3 (``LoRAExpertsMixin`` + ``FusedMoEExpertsModular``, 0.21+):

- a batch without LoRA (the punica wrapper's ``no_lora_flag_cpu``) takes ``Exl3MoEMethod.apply``, the fused path;
- a batch with LoRA: gate and up per (token, expert) assignment into ``cache1`` (M, topk, 2I), the LoRA delta
  (``apply_w13_lora``), SiLU-and-mul into ``cache2`` (M x topk, I), down with the routed weights summed per token
  (the EXL3 kernels' own weighted reduction), plus the down delta (``apply_w2_lora``, routed weights applied by the
  kernel) summed with ``moe_sum``. Per token, ``exl3_mgemm`` over the token's experts (the calls of
  ``_apply_small_batch``, fixed shapes, so CUDA graphs can hold them) inside a capture and up to
  ``PER_EXPERT_FROM`` tokens; per expert, ``Exl3MoEMethod._apply_exl3`` over its tokens (a host sync, outside
  capture) above.

``w1`` and ``w2`` are read by aphrodite's MoE code for their shapes only (``moe_problem_size``, the LoRA kernels'
config lookup): ``shape_tensors`` gives them as stride-0 views of one element on the layer's device. The EXL3 kernels
take float16, the LoRA kernels the model's dtype: the input and the activation are cast at those two points.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Mapping
from typing import Any

from hybrid_exl3_fixes.registry import Drift, NotApplicable, Patch, Target, opted_in, tag, tags_of
from hybrid_exl3_fixes.shared import MOE_LOAD, builds_after_loading, exl3_moe_method_has_no_lora_kernel

ENABLE_ENV = "HYBRID_EXL3_FIXES_MOE_EXPERT_LORA"
PER_EXPERT_FROM = 64  # outside a CUDA-graph capture, batches of more tokens take the per-expert path
MIXIN_MODULES = (  # LoRAExpertsMixin: 0.22+ under experts/, 0.21 beside modular_kernel; 0.20 has none
    "aphrodite.model_executor.layers.fused_moe.experts.lora_experts_mixin",
    "aphrodite.model_executor.layers.fused_moe.lora_experts_mixin",
)


def enabled(environ: Mapping[str, str]) -> bool:
    """P13 on: ``HYBRID_EXL3_FIXES_MOE_EXPERT_LORA=1`` (or true / on / yes)."""
    return opted_in(environ, ENABLE_ENV)


def lora_experts_mixin() -> type | None:
    """The live ``LoRAExpertsMixin``, or None where the release has none (0.20)."""
    for name in MIXIN_MODULES:
        try:
            return importlib.import_module(name).LoRAExpertsMixin
        except (ImportError, AttributeError):
            continue
    return None


def shape_tensors(layer: Any, dtype) -> tuple[Any, Any]:
    """``w1`` (E, 2I, H) and ``w2`` (E, H, I) as aphrodite's MoE code reads them, without their memory."""
    import torch

    experts, inter, hidden = layer.local_num_experts, layer.exl3_intermediate_size_per_partition, layer.hidden_size
    one = torch.zeros(1, dtype=dtype, device=layer.exl3_gate_ptrs_trellis.device)
    return one.expand(experts, 2 * inter, hidden), one.expand(experts, hidden, inter)


def fused_apply(method: Any, layer: Any, x, topk_weights, topk_ids):
    """``method.apply`` as the release defines it (0.22+ add the shared-expert arguments, passed as None)."""
    extra = list(inspect.signature(inspect.unwrap(type(method).apply)).parameters)[5:]
    return method.apply(layer, x, topk_weights, topk_ids, **dict.fromkeys(extra))


def batch_has_lora(ctx: Any) -> bool:
    """False when the punica wrapper marked this batch as without LoRA (a CPU flag, read before each forward and at
    each capture); True when it cannot tell."""
    flag = getattr(getattr(ctx.punica_wrapper, "token_mapping_meta", None), "no_lora_flag_cpu", None)
    return flag is None or not bool(flag[0])


def gate_up_per_token(layer: Any, ops, x16, ids, cache1) -> None:
    """cache1[t, j] = [gate | up] of token t through its j-th expert, one ``exl3_mgemm`` pass per token (the
    one-token path's calls; fixed shapes, so a CUDA graph can hold them)."""
    inter = cache1.shape[-1] // 2
    for t in range(x16.shape[0]):
        row, row_ids = x16[t : t + 1].unsqueeze(0), ids[t : t + 1]
        if layer.exl3_fuse_gate_up:
            ops.make_gate_up_indices(layer.exl3_small_gate_up_ids, row_ids, layer.local_num_experts)
            ops.exl3_mgemm(
                row, layer.exl3_gate_up_ptrs_trellis, layer.exl3_small_interm_gu, layer.exl3_gate_up_ptrs_suh,
                layer.exl3_small_yh_gu, layer.exl3_gate_up_ptrs_svh, layer.exl3_small_gate_up_ids, None,
                layer.exl3_moe_k_gate, -1, layer.exl3_gate_mcg, layer.exl3_gate_mul1, -1, -1, 0,
            )  # fmt: skip
        else:
            for which, out in (("gate", layer.exl3_small_interm_g), ("up", layer.exl3_small_interm_u)):
                ops.exl3_mgemm(
                    row, getattr(layer, f"exl3_{which}_ptrs_trellis"), out, getattr(layer, f"exl3_{which}_ptrs_suh"),
                    layer.exl3_small_yh, getattr(layer, f"exl3_{which}_ptrs_svh"), row_ids, None,
                    getattr(layer, f"exl3_moe_k_{which}"), -1, getattr(layer, f"exl3_{which}_mcg"),
                    getattr(layer, f"exl3_{which}_mul1"), -1, -1, 0,
                )  # fmt: skip
        cache1[t, :, :inter].copy_(layer.exl3_small_interm_g[:, 0])
        cache1[t, :, inter:].copy_(layer.exl3_small_interm_u[:, 0])


def down_per_token(layer: Any, ops, cache2, ids, weights16, out) -> None:
    """out[t] = sum_j w[t, j] * down_j(cache2[t, j]), the one-token path's weighted ``exl3_mgemm`` per token."""
    k = ids.shape[1]
    act = cache2.view(-1, k, cache2.shape[-1])
    for t in range(ids.shape[0]):
        layer.exl3_small_interm_a[:, 0].copy_(act[t])
        ops.exl3_mgemm(
            layer.exl3_small_interm_a, layer.exl3_down_ptrs_trellis, layer.exl3_small_out_d,
            layer.exl3_down_ptrs_suh, layer.exl3_small_interm_a, layer.exl3_down_ptrs_svh, ids[t : t + 1],
            weights16[t : t + 1], layer.exl3_moe_k_down, layer.exl3_down_force_shape, layer.exl3_down_mcg,
            layer.exl3_down_mul1, -1, -1, layer.exl3_down_force_num_sms,
        )  # fmt: skip
        out[t].copy_(layer.exl3_small_out_d[0, 0])


def assignments_by_expert(ids) -> list[tuple[int, Any]]:
    """(expert, flat assignment positions t * topk + j) for every expert with work, in expert order (a host sync)."""
    import torch

    flat = ids.reshape(-1)
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=1).tolist()
    out, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            out.append((expert, order[start : start + count]))
        start += count
    return out


def gate_up_per_expert(method_cls: type, layer: Any, groups, k: int, x16, cache1) -> None:
    """``gate_up_per_token``'s result, per expert over all its tokens (``_apply_exl3``: the small-row GEMM up to 32
    rows, the rebuild above), for batches too large for a token loop, outside capture; ``groups``:
    ``assignments_by_expert``."""
    flat = cache1.view(-1, cache1.shape[-1])
    inter = flat.shape[-1] // 2
    for expert, pos in groups:
        rows = x16.index_select(0, pos // k)
        flat[pos, :inter] = method_cls._apply_exl3(layer, "w13", rows, expert, "w1").to(flat.dtype)
        flat[pos, inter:] = method_cls._apply_exl3(layer, "w13", rows, expert, "w3").to(flat.dtype)


def down_per_expert(method_cls: type, layer: Any, groups, k: int, cache2, weights, out) -> None:
    """``down_per_token``'s result (weighted, summed into ``out``, float32), per expert over all its tokens."""
    for expert, pos in groups:
        rows = cache2.index_select(0, pos).half()  # the EXL3 kernels take float16
        down = method_cls._apply_exl3(layer, "w2", rows, expert, "w2").float()
        out.index_add_(0, pos // k, down * weights.reshape(-1)[pos].float().unsqueeze(-1))


def build_experts_class() -> type:
    """``Exl3LoRAExperts`` on the live release's bases (``NotImplementedError`` where it has no LoRAExpertsMixin)."""
    import aphrodite.model_executor.layers.fused_moe.modular_kernel as mk
    import torch
    from aphrodite import _custom_ops as ops
    from aphrodite.model_executor.layers.fused_moe.activation import MoEActivation
    from aphrodite.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

    mixin = lora_experts_mixin()
    if mixin is None:
        raise NotImplementedError("this aphrodite has no LoRAExpertsMixin (0.21+ have it)")

    class Exl3LoRAExperts(mixin, mk.FusedMoEExpertsModular):
        """The experts of one EXL3 MoE layer for ``FusedMoEWithLoRA``: the fused kernel without LoRA, the
        decomposed path with it (module docstring)."""

        def __init__(self, method: Any, layer: Any, moe_config: Any, quant_config: Any):
            super().__init__(moe_config, quant_config)
            self.method, self.layer = method, layer

        @staticmethod
        def activation_format():
            return mk.FusedMoEActivationFormat.Standard

        @staticmethod
        def _supports_current_device() -> bool:
            return torch.cuda.is_available()

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return False

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key) -> bool:
            return True

        @staticmethod
        def _supports_activation(activation) -> bool:
            return activation == MoEActivation.SILU

        @staticmethod
        def _supports_parallel_config(moe_parallel_config) -> bool:
            return not getattr(moe_parallel_config, "use_ep", False)

        def supports_expert_map(self) -> bool:  # 0.21's abstract method
            return False

        def workspace_shapes(
            self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation
        ):
            # The modular kernel hands out the output as a view of workspace13's memory (both releases'
            # _allocate_buffers): workspace13 holds cache2 (M x topk, I), read before the output is written;
            # workspace2 holds cache1 (M x topk, N = 2I), then the down delta (M x topk, K), which is summed into the
            # output and so must not share its memory
            return (M * topk, N // 2), (M * topk, max(N, K)), (M, K)

        def finalize_weight_and_reduce_impl(self):
            return TopKWeightAndReduceNoOP()  # apply writes each token's weighted sum itself

        def apply(
            self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
            a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta, apply_router_weight_on_input,
        ):  # fmt: skip
            ctx = self._lora_context
            if ctx is None or not batch_has_lora(ctx):
                output.copy_(fused_apply(self.method, self.layer, hidden_states, topk_weights, topk_ids))
                return
            layer, (m, k), hidden = self.layer, topk_ids.shape, hidden_states.shape[-1]
            inter = w1.shape[1] // 2
            # 0.23+ padding rows (-1) to expert 0, their output discarded; the EXL3 kernels index with int64, the
            # LoRA alignment takes the router's own dtype (int32 under FusedMoEModularMethod)
            lora_ids = topk_ids.clamp(min=0)
            ids = lora_ids.to(torch.long)
            x16 = hidden_states.to(torch.float16).contiguous()
            cache1 = workspace2.view(-1)[: m * k * 2 * inter].view(m, k, 2 * inter)
            cache2 = workspace13.view(-1)[: m * k * inter].view(m * k, inter)
            token_loop = torch.cuda.is_current_stream_capturing() or m <= PER_EXPERT_FROM
            groups = None if token_loop else assignments_by_expert(ids)  # one host sync, for both halves
            if token_loop:
                gate_up_per_token(layer, ops, x16, ids, cache1)
            else:
                gate_up_per_expert(type(self.method), layer, groups, k, x16, cache1)
            meta = self.apply_w13_lora(
                ctx, y=cache1, x=hidden_states, topk_ids=lora_ids, topk_weights=topk_weights, expert_map=None, w1=w1,
                w2=w2, num_tokens=m, top_k_num=k,
            )  # fmt: skip
            self.activation(activation, cache2, cache1.view(-1, 2 * inter))  # SiLU(gate) x up, gate first
            base = torch.zeros((m, hidden), dtype=torch.float32, device=hidden_states.device)
            if token_loop:
                down_per_token(layer, ops, cache2, ids, topk_weights.to(torch.float16), base)
            else:
                down_per_expert(type(self.method), layer, groups, k, cache2, topk_weights, base)
            delta = workspace2.view(-1)[: m * k * hidden].view(m, k, hidden)
            delta.zero_()
            self.apply_w2_lora(
                ctx, y=delta, x=cache2, topk_weights=topk_weights, sorted_token_ids_lora=meta[0],
                expert_ids_lora=meta[1], num_tokens_post_padded_lora=meta[2], token_lora_mapping=meta[3],
                num_tokens=m, w1=w1, w2=w2, top_k_num=k,
            )  # fmt: skip
            ops.moe_sum(delta, output)
            output.add_(base.to(output.dtype))

    return Exl3LoRAExperts


_EXPERTS: dict[str, type] = {}


def experts_class() -> type:
    """``build_experts_class()``, built once per process."""
    if "cls" not in _EXPERTS:
        _EXPERTS["cls"] = build_experts_class()
    return _EXPERTS["cls"]


def make_kernel(method: Any, layer: Any) -> Any:
    """A ``FusedMoEKernel`` (no DP/EP prepare and finalize, ``Exl3LoRAExperts``) for ``FusedMoEWithLoRA`` to take from
    ``method.moe_kernel``; also gives the layer the ``w13_weight`` / ``w2_weight`` shape tensors that
    ``FusedMoEModularMethod.apply`` passes on."""
    import aphrodite.model_executor.layers.fused_moe.modular_kernel as mk
    from aphrodite.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from aphrodite.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    experts = experts_class()(method, layer, method.moe, FUSED_MOE_UNQUANTIZED_CONFIG)
    layer.w13_weight, layer.w2_weight = shape_tensors(layer, method.moe.in_dtype)
    return mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts)


LORA_WRAPPER = "aphrodite.lora.layers.fused_moe"
REPLACE = Target("aphrodite.lora.utils", "replace_submodule", params=("model", "module_name", "new_module"))
REPLACE_MANAGER = Target("aphrodite.lora.model_manager", "replace_submodule", binds=REPLACE.key)


def probe_moe_expert_lora(live) -> bool:
    """True = the EXL3 MoE method has no LoRA-capable kernel and P13 is not in place."""
    if not enabled(os.environ):
        raise NotApplicable(
            "an experimental opt-in (not yet correct in batches that mix requests): set "
            f"{ENABLE_ENV}=1 to serve adapters on the routed experts of EXL3 MoE layers (without it P5 "
            "refuses them by name)"
        )
    if lora_experts_mixin() is None:
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
        experts = experts_class()
    except (ImportError, AttributeError, NotImplementedError) as exc:
        raise Drift(f"the EXL3 LoRA experts cannot be built on this release: {exc}") from exc
    if getattr(experts, "__abstractmethods__", None):
        raise Drift(f"the EXL3 LoRA experts miss {sorted(experts.__abstractmethods__)} of this release's interface")
    return exl3_moe_method_has_no_lora_kernel() and "P13" not in tags_of(live[MOE_LOAD.key].raw)


# (method, layer, the layer's own w13_weight / w2_weight or None) of every layer given a kernel; reset_state undoes them
_GIVEN: list[tuple[Any, Any, dict]] = []


def give_lora_kernel(method: Any, layer: Any) -> None:
    """With LoRA on, the method's ``moe_kernel`` for ``FusedMoEWithLoRA`` (nothing changes with LoRA off)."""
    if getattr(method.moe, "is_lora_enabled", False) and method.moe_kernel is None:
        before = {name: vars(layer)[name] for name in ("w13_weight", "w2_weight") if name in vars(layer)}
        method.moe_kernel = make_kernel(method, layer)
        _GIVEN.append((method, layer, before))


def reset_state() -> None:
    """P13's undo of what it did at load time: every method it gave a kernel has none again (``moe_kernel`` None, as
    ``Exl3MoEMethod`` sets it), every layer its own ``w13_weight`` / ``w2_weight`` back (or none)."""
    for method, layer, before in reversed(_GIVEN):
        method.moe_kernel = None
        for name in ("w13_weight", "w2_weight"):
            vars(layer).pop(name, None)
            if name in before:
                setattr(layer, name, before[name])
    _GIVEN.clear()


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


PATCH = Patch(
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
    on_undo=reset_state,
    checks_tag_after_apply=True,
    after=("P10",),  # P10 first: the LoRA kernel is given once the layer's own load, P10's included, has finished
    symptom="adapters on the routed experts of EXL3 MoE layers: experimental, still wrong in mixed batches",
    opt_in="HYBRID_EXL3_FIXES_MOE_EXPERT_LORA",
)
