"""P3: mixed EXL3 codebooks in one process at <= 32 rows.

Target: ``aphrodite/model_executor/layers/quantization/exl3.py``.

Why:     ``_exl3_linear_one`` sends <= 32 rows to ``ops.exl3_gemm``, whose compiled kernel
         selection (``select_exl3_gemm_mgemm_kernel_new`` in csrc/.../exl3_kernel_map.cu) caches
         the kernel per ``(size_k, size_n, cc, K, c_fp32)`` -- without the codebook. Every later
         layer of that shape and bitrate runs the first one's codebook kernel and computes
         wrong numbers (relative error about 1.5) whatever its own mcg/mul1 flag says: a draft
         or MTP model quantized differently, a model whose layers mix codebooks, two models in
         one process. Measured on an H200 with aphrodite-engine 0.21.0; read from the 0.20.0 and
         0.21.0 binaries (overlay/decisions/exl3_kernels.py, docs/upstream/exl3-gemm-codebook-cache.md).
How:     Python cannot reach the C++ cache, so the plan is made at load time, per layer, after
         the original ``process_weights_after_loading``: a GPU probe (once per process and
         device, a few small GEMMs) confirms the behaviour and that the uncached launch
         (``force_shape_idx``/``force_num_sms``) is right for every codebook; the first layer
         (or the probe) to use a cache key owns it; a later layer of another codebook on that
         key gets an instance-level ``_apply_one`` that calls the uncached launch (or, if the
         probe found it wrong, the reconstruct path) for its shards. Layers that own their key
         -- every layer of a single-codebook model -- are not touched and pay nothing per call.
         One WARNING per process names the first routed layer; the rest are logged at INFO.
Upstream: not reported before this project; report draft and fix in
         docs/upstream/exl3-gemm-codebook-cache.md and patches/0003-exl3-gemm-codebook-cache.patch.
         aphrodite-engine 0.24.0 (and 0.24.1) keys its replacement autotuner on the codebook
         (``gemm_autotune_hash(..., cb)``): the probe reports UPSTREAM_FIXED there.
Retire when: the oldest supported aphrodite-engine is 0.24.x.
"""

from __future__ import annotations

import types
from typing import Any

from hybrid_exl3_fixes.decisions import exl3_kernels as kernels
from hybrid_exl3_fixes.decisions import p3_gemm_cache as p3_plan
from hybrid_exl3_fixes.registry import (
    Live,
    Patch,
    logger,
)
from hybrid_exl3_fixes.shared import (
    CODEBOOK_FLAGS,
    PROCESS_WEIGHTS,
    _routed_apply_one,
    after_loading,
    codebook_of,
    routed_linear,
    table_dispatch_unpatched,
)

# The probe's cache key: (in, out, K) = (384, 256, 2) is no projection of a Qwen3.5/3.6 model,
# and the probe claims it for mcg like any layer, so a real layer on it is still planned right.
PROBE_SHAPE = (384, 256, 2)
PROBE_ROWS = 4

PLANNER = p3_plan.Planner()
VERDICTS: dict[int, p3_plan.ProbeVerdict] = {}  # per CUDA device index, for this process
_warned = False
# (method, layer, exl3_can_mgemm before planning) of every layer the plan changed; reset_state undoes them
_CHANGED: list[tuple[Any, Any, Any]] = []


def reset_state() -> None:
    """P3's undo of what it did at load time: every routed layer gets its own ``exl3_can_mgemm`` back and
    loses its routes, every method its instance ``_apply_one``; the planner, the probe verdicts and the
    warn-once flag start afresh. (The ``exl3_linear_routed`` custom op stays registered with torch: an op
    cannot be unregistered, and nothing calls it once no layer is routed.)"""
    global _warned
    for method, layer, can_mgemm in reversed(_CHANGED):
        vars(method).pop("_apply_one", None)
        vars(layer).pop("hxf_exl3_routes", None)
        if can_mgemm is not None:
            layer.exl3_can_mgemm = can_mgemm
    _CHANGED.clear()
    PLANNER.owners.clear()
    VERDICTS.clear()
    _warned = False


def probe_codebook_blind_gemm_cache(live: dict[str, Live]) -> bool:
    """A codebook-blind cache is a bug until this patch plans the loads; True = buggy."""
    return table_dispatch_unpatched(live, "P3")


def build_load_time_plan(live: dict[str, Live]) -> dict[str, Any]:
    original = live[PROCESS_WEIGHTS.key].function
    failure = "hybrid-exl3-fixes: P3 could not plan %s; it keeps aphrodite's own path"
    return {PROCESS_WEIGHTS.key: after_loading("P3", original, plan_layer, failure, "prefix")}


def small_batch_gemm_shards(layer) -> list:
    """The shards whose <= 32-row calls reach exl3_gemm (fused gate/up and k/v take exl3_mgemm)."""
    if getattr(layer, "exl3_can_mgemm", False):
        mode = getattr(layer, "exl3_mgemm_mode", None)
        if mode == "gate_up":
            return []
        if mode == "qkv_kv":
            return ["q"]
    return list(layer.exl3_shard_ids)


def plan_layer(
    method, layer, verdict: p3_plan.ProbeVerdict | None = None, device_class: str = "hopper", device_sms: int = 132
) -> dict:
    """Claim this layer's exl3_gemm keys; route the shards whose key another codebook owns.
    Returns the routes {shard id: (force_shape_idx, force_num_sms)}, (0, 0) = reconstruct path."""
    if verdict is None:
        verdict, device_class, device_sms = device_verdict(next(iter(layer.trellis.exl3_tensors.values())).device)
    if not verdict.codebook_blind:
        return {}
    name = getattr(layer, "prefix", "") or type(layer).__name__

    def entries(shards):
        return [
            (s, kernels.gemm_key(tuple(layer.trellis.exl3_tensors[s].shape)), codebook_of(layer, s)) for s in shards
        ]

    shards = small_batch_gemm_shards(layer)
    can_mgemm = None
    if getattr(layer, "exl3_can_mgemm", False) and any(
        PLANNER.conflicts_with(key, cb) for _, key, cb in entries(shards)
    ):
        # q of a fused qkv conflicts: q, k and v each take the per-shard path, planned below
        can_mgemm, layer.exl3_can_mgemm = layer.exl3_can_mgemm, False
        shards = list(layer.exl3_shard_ids)
    routes = {}
    for shard, key, cb in entries(shards):
        label = name if shard is None else f"{name}[{shard!r}]"
        owner = PLANNER.claim(key, cb, label)
        if owner is None:
            continue
        launch = kernels.forced_launch(device_class, *key, device_sms) if verdict.forced_ok else None
        routes[shard] = launch or (0, 0)
        _report_route(label, cb, key, owner, routes[shard])
    if routes or can_mgemm is not None:
        _CHANGED.append((method, layer, can_mgemm))
    if routes:
        layer.hxf_exl3_routes = routes
        method._apply_one = types.MethodType(_routed_apply_one, method)
    return routes


def _report_route(label: str, codebook: str, key, owner, route) -> None:
    global _warned
    how = f"uncached kernel launch (shape {route[0]}, {route[1]} SMs)" if route[0] else "reconstruct path"
    what = (
        f"{label} ({codebook}, {key[0]} -> {key[1]}, {key[2]} bits) shares aphrodite's small-batch "
        f"GEMM cache key with {owner[1]} ({owner[0]}); routed to the {how}"
    )
    if _warned:
        logger.info("hybrid-exl3-fixes: P3: %s", what)
        return
    _warned = True
    logger.warning(
        "hybrid-exl3-fixes: P3: EXL3 layers of one shape and bitrate use different codebooks in this "
        "process, and aphrodite's <= 32-row GEMM would run them all with the first one's kernel "
        "(docs/upstream/exl3-gemm-codebook-cache.md). %s. Further routed layers are logged at INFO.",
        what,
    )


def device_verdict(device) -> tuple[p3_plan.ProbeVerdict, str, int]:
    """The runtime probe's answer for this CUDA device, measured once per process and device."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    device_class = kernels.compute_class(props.major, props.minor)
    verdict = VERDICTS.get(index)
    if verdict is None:
        try:
            with torch.cuda.device(index):
                verdict = p3_plan.read_probe(measure_gemm_cache(index, device_class, props.multi_processor_count))
        except Exception as exc:  # e.g. no kernel for the probe's shape on this device: route nothing
            verdict = p3_plan.ProbeVerdict(None, False, f"the probe raised {type(exc).__name__}: {exc}")
        VERDICTS[index] = verdict  # asked once per process and device, whatever the answer
        if verdict.codebook_blind:
            PLANNER.claim(PROBE_SHAPE, "mcg", "the hybrid-exl3-fixes probe")
            logger.info(
                "hybrid-exl3-fixes: P3 probe on cuda:%d: the <= 32-row EXL3 GEMM keeps the first codebook "
                "per shape; uncached launch %s (%s)",
                index,
                "right" if verdict.forced_ok else "WRONG",
                verdict.detail,
            )
        elif verdict.codebook_blind is None:
            logger.warning(
                "hybrid-exl3-fixes: P3 probe on cuda:%d gave no clear answer, so no layer is routed: %s",
                index,
                verdict.detail,
            )
        else:
            logger.info(
                "hybrid-exl3-fixes: P3 probe on cuda:%d: the EXL3 GEMM honours each codebook; nothing to route (%s)",
                index,
                verdict.detail,
            )
    return verdict, device_class, props.multi_processor_count


def measure_gemm_cache(index: int, device_class: str, device_sms: int) -> dict[str, float]:
    """Run the probe's GEMMs on cuda:<index>; returns relative errors for p3_plan.read_probe.
    References come from aphrodite's own reconstruct path (more than 32 rows), which decodes
    every codebook right."""
    import aphrodite.model_executor.layers.quantization.exl3  # noqa: F401 - registers the op
    import torch

    from hybrid_exl3_fixes.checkpoint import codec

    k, n, K = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    tensors = codec.random_exl3_linear(k, n, K, "mcg", gen)
    trellis, suh, svh = (tensors[name].to(f"cuda:{index}") for name in ("trellis", "suh", "svh"))
    x_big = torch.randn(kernels.SMALL_BATCH_ROWS + 1, k, generator=gen).to(torch.float16).to(f"cuda:{index}")
    x = x_big[:PROBE_ROWS].contiguous()
    linear = torch.ops.aphrodite.exl3_linear_one

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    ref = {cb: linear(x_big, trellis, suh, svh, *flags)[:PROBE_ROWS] for cb, flags in CODEBOOK_FLAGS.items()}
    first = linear(x, trellis, suh, svh, *CODEBOOK_FLAGS["mcg"])
    second = linear(x, trellis, suh, svh, *CODEBOOK_FLAGS["mul1"])
    errors = {
        "first": rel(first, ref["mcg"]),
        "second": rel(second, ref["mul1"]),
        "second_vs_first": rel(second, ref["mcg"]),
    }
    launch = kernels.forced_launch(device_class, k, n, K, device_sms)
    for cb, flags in CODEBOOK_FLAGS.items():
        errors[f"forced_{cb}"] = rel(routed_linear()(x, trellis, suh, svh, *flags, *launch), ref[cb])
    return errors


PATCH = Patch(
    id="P3",
    slug="exl3-gemm-codebook-cache",
    title="EXL3 <= 32-row GEMM keeps the first codebook per shape (mixed-codebook processes)",
    upstream="docs/upstream/exl3-gemm-codebook-cache.md (not reported upstream before this project)",
    fixed_in="0.24.0",
    retire_when="the oldest supported aphrodite-engine is 0.24.x",
    targets=(PROCESS_WEIGHTS,),
    probe=probe_codebook_blind_gemm_cache,
    build=build_load_time_plan,
    on_undo=reset_state,
    checks_tag_after_apply=True,
    symptom="layers of one shape but different EXL3 codebooks answer wrongly at up to 32 rows",
)
