"""P10: EXL3 routed experts under CUDA-graph capture: the fused kernel's device context must exist before it.

Target: ``aphrodite/model_executor/layers/quantization/exl3.py``.

Why:     exllamav3's kernels allocate their per-device context lazily (``DevCtx::get_locks``: ``cudaMalloc`` +
         ``cudaMemset`` on first use, csrc/quantization/exl3/exllamav3_ext/quant/exl3_devctx.cu; the MoE kernel,
         exl3_gemm and exl3_gemv share it). 0.24.0's kernel update made ``exl3_moe`` return before that when no
         expert has work (``if (num_active == 0) return;``, exl3_moe.cu, ``num_active`` from
         ``Exl3MoEMethod.apply``), and since 0.23.0 every row of a warm-up or profiling batch is padding, expert
         id -1 (P9 sends those to the kernel's spare slot). So no eager call launches the fused kernel with work,
         and where no other exllamav3 kernel ran eagerly either, its first launch comes inside a CUDA-graph
         capture (num_active = -1 there): the allocation invalidates the capture and the launch reports it,
         ``operation failed due to a previous error during capture ... exl3_moe.cu 295``. The method captured on
         its own fails so on 0.24.1; a served model whose dense layers are EXL3 gets the context from their
         eager exl3_gemm / exl3_gemv calls first and starts without P10 (docs/upstream/exl3-moe-context-in-capture.md
         has both measurements). P10 makes the experts' capture independent of what else ran before it. 0.23.0
         launches on every call and is not affected.
How:     after the original ``process_weights_after_loading``, one eager call of the live ``apply`` with a few
         zero rows routed to real experts (weight 0) takes the fused kernel with work: the context is allocated
         and the kernel's shared-memory attribute set at load time. Per layer, once; nothing changes per step.
Probe:   NOT_APPLICABLE where the routers never mark padding (0.20 - 0.22) or ``ops.exl3_moe`` takes no
         ``num_active`` (0.23.0); buggy unless the load path already calls ``ops.exl3_moe`` itself. A fix in the
         C++ alone (patches/0010's exl3_moe.cu half) is invisible to the probe: the launch then costs one
         kernel per layer at load and changes nothing else.
Upstream: not reported yet; the upstream-ready diff is patches/0010-exl3-moe-context-in-capture.patch.
Retire when: an aphrodite release prepares the context before the idle-launch return (or at load) and is the
         oldest supported one.
"""

from __future__ import annotations

from hybrid_exl3_fixes.registry import (
    MARKER,
    Drift,
    Live,
    NotApplicable,
    Patch,
)
from hybrid_exl3_fixes.shared import MOE_LOAD, builds_after_loading, marks_padding_rows, source_tree

MOE_SETUP = "_setup_fused_moe_kernel"


def kernel_skips_idle_launches() -> bool:
    """Whether this release's ``ops.exl3_moe`` takes ``num_active`` (0.24+): the kernel then returns before it
    touches exllamav3's device context when no expert has work, as in every padded warm-up batch."""
    import inspect

    from aphrodite import _custom_ops as ops

    op = getattr(ops, "exl3_moe", None)
    if op is None:
        raise NotApplicable("this release has no EXL3 MoE kernel (aphrodite._custom_ops.exl3_moe)")
    try:
        return "num_active" in inspect.signature(op).parameters
    except (TypeError, ValueError) as exc:
        raise Drift(f"aphrodite._custom_ops.exl3_moe has no readable signature: {exc}") from exc


def launches_at_setup(method_class) -> bool:
    """True when the live load path (``process_weights_after_loading`` and the class's own methods it reaches, such
    as ``_setup_fused_moe_kernel``) calls ``ops.exl3_moe`` itself: a warm-up launch upstream."""
    import ast
    import inspect

    seen, todo = set(), ["process_weights_after_loading"]
    while todo:
        name = todo.pop()
        seen.add(name)
        function = inspect.getattr_static(method_class, name, None)
        function = getattr(function, "__func__", function)
        if getattr(function, MARKER, None) == "P10":
            function = getattr(function, "__wrapped__", None)
        if not callable(function):
            continue
        tree = source_tree(function, f"Exl3MoEMethod.{name}")
        attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        if attributes & {"exl3_moe", "exl3_moe_active"}:
            return True
        todo += [a for a in attributes - seen if callable(inspect.getattr_static(method_class, a, None))]
    return False


def probe_moe_context_before_capture(live: dict[str, Live]) -> bool:
    """True = buggy: padding rows carry expert id -1 (so every warm-up and profiling batch leaves the experts
    idle), the kernel skips idle launches before it allocates its device context, and nothing at load time
    launches it with work."""
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    if getattr(live[MOE_LOAD.key].function, MARKER, None) == "P10":
        return False
    if not marks_padding_rows():
        raise NotApplicable("this release's routers give the warm-up batches real experts (0.23+ mark padding)")
    if not kernel_skips_idle_launches():
        raise NotApplicable("this release's exl3_moe launches on every call (0.24+ skip idle launches)")
    return not launches_at_setup(exl3.Exl3MoEMethod)


def warm_fused_kernel(method, layer) -> int:
    """One eager call of ``method.apply`` that takes the fused kernel with work for it: threshold + 1 rows of
    zeros, row t on experts t*k .. t*k + k - 1 (mod E, distinct within a row), weight 0. Every expert gets at
    most a couple of tokens, far below the kernel's capacity, so nothing else runs. The kernel then allocates
    exllamav3's device context (its lock buffer, cudaMalloc + cudaMemset) and sets its kernel's shared-memory
    attribute here, outside any CUDA-graph capture. Returns the rows used."""
    import inspect

    import torch

    experts, k = layer.local_num_experts, layer.top_k
    device = layer.exl3_gate_ptrs_trellis.device
    rows = max(2, getattr(layer, "exl3_small_batch_threshold", 1) + 1)
    ids = (torch.arange(rows * k, device=device) % experts).reshape(rows, k)
    x = torch.zeros(rows, layer.hidden_size, dtype=torch.float16, device=device)
    weights = torch.zeros(rows, k, dtype=torch.float32, device=device)
    # 0.22+: the shared-expert arguments
    extra = list(inspect.signature(inspect.unwrap(type(method).apply)).parameters)[5:]
    method.apply(layer, x, weights, ids, **dict.fromkeys(extra))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return rows


build_moe_context_warmup = builds_after_loading(
    "P10",
    MOE_LOAD,
    warm_fused_kernel,
    "hybrid-exl3-fixes: P10 could not launch the EXL3 MoE kernel for %s at load time; CUDA-graph capture may stop at "
    "exl3_moe.cu (docs/upstream/exl3-moe-context-in-capture.md). --enforce-eager avoids it",
    "layer_name",
)


PATCH = Patch(
    id="P10",
    slug="exl3-moe-context-in-capture",
    title="EXL3 routed experts: launch the fused kernel once at load, so its device context exists before "
    "CUDA-graph capture (0.24+)",
    upstream="not reported yet (patches/0010-exl3-moe-context-in-capture.patch)",
    fixed_in=None,
    retire_when="an aphrodite release allocates exllamav3's device context before the kernel's idle-launch return "
    "(or at load) and is the oldest supported one",
    targets=(MOE_LOAD,),
    probe=probe_moe_context_before_capture,
    build=build_moe_context_warmup,
    checks_tag_after_apply=True,
    symptom="EXL3 MoE stops in CUDA-graph capture at `exl3_moe.cu 295`",
)
