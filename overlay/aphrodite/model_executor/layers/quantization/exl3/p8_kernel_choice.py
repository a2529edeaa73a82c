"""P8: the <= 32-row EXL3 GEMM's kernel, measured per layer at load instead of looked up.

Target: ``aphrodite/model_executor/layers/quantization/exl3.py``.

Why:     ``_exl3_linear_one`` sends <= 32 rows to ``ops.exl3_gemm`` with ``force_shape_idx = -1``; in 0.20 - 0.23
         the kernel's tiling and SM count are then the nearest entry of the port's sample tables
         (``select_exl3_gemm_mgemm_kernel_new``, csrc/.../exl3_kernel_map.cu), one choice per shape for every row
         count. On an H200 the fastest launch of the same kernels takes 0.83-0.89 of that choice's time for some
         Qwen3.6-27B projections (down_proj at every row count), and at one request these GEMMs are the decode
         step (docs/upstream/exl3-small-batch-kernel-choice.md).
How:     after the original ``process_weights_after_loading`` (and P3's plan), each shard that takes ``exl3_gemm``
         at <= 32 rows is timed on its own weights, once per (shape, bits, codebook) and device in the process:
         the native launch against the uncached launches of every tiling shape (``choice.candidates``) at 1, 8,
         16 and 32 rows, interleaved, CUDA events, median of rounds. Where a launch beats the native one by more
         than 3 % at a row count, and gives the reconstruct path's numbers on this layer (the probe: relative
         error < 2e-2), the shard's calls of up to that many rows take it (``exl3_linear_chosen``, a custom op,
         so torch.compile and CUDA graphs treat it like aphrodite's); elsewhere the layer keeps aphrodite's path
         untouched. Shards P3 already routes and fused gate/up and q/k/v layers (aphrodite's ``exl3_gate_up`` and
         ``exl3_qkv`` ops: ``exl3_mgemm`` picks by exllamav3's heuristic, no table; q runs inside the op) are left
         as they are. Each measured shape is logged at INFO with its times; a failing measurement keeps the native
         path and is logged.
Upstream: not reported; the write-up above has the report and the minimal fix. aphrodite-engine 0.24.0 replaced the
         sample tables with an autotuner that measures per shape and row count (``gemm_autotune_hash``): the probe
         reports UPSTREAM_FIXED there.
Retire when: the oldest supported aphrodite-engine is 0.24.x.
"""

from __future__ import annotations

import types
from typing import Any

from hybrid_exl3_fixes.decisions import exl3_kernels as kernels
from hybrid_exl3_fixes.decisions import p8_kernel_choice as choice
from hybrid_exl3_fixes.registry import Patch, logger
from hybrid_exl3_fixes.shared import (
    CODEBOOK_FLAGS,
    PROCESS_WEIGHTS,
    _routed_apply_one,
    after_loading,
    codebook_of,
    routed_linear,
    shard_operands,
    table_dispatch_unpatched,
    time_interleaved,
)

ROUNDS = 5  # timed rounds per launch and row count; the median is kept
CALLS = 8  # calls per round, between one pair of CUDA events
WARMUP = 3

# (device index, k, n, K, codebook) -> (choice, times): measured once per process
CHOICES: dict[tuple, tuple[choice.Choice, dict]] = {}
# (method, previous instance _apply_one or None) of every layer P8 routed; reset_state undoes them
_CHANGED: list[tuple[Any, Any, Any]] = []


def reset_state() -> None:
    """P8's undo of what it did at load time: each routed method gets back the ``_apply_one`` it had (P3's or the
    class's), each layer loses its choices; the measured choices start afresh."""
    for method, layer, previous in reversed(_CHANGED):
        vars(layer).pop("hxf_exl3_chosen", None)
        if previous is None:
            vars(method).pop("_apply_one", None)
        else:
            method._apply_one = previous
    _CHANGED.clear()
    CHOICES.clear()


def probe_table_kernel_choice(live) -> bool:
    """The sample-table choice of 0.20 - 0.23 is what P8 replaces; 0.24's autotuner is the fix upstream. True = the
    table choice is there and P8 is not."""
    return table_dispatch_unpatched(live, "P8")


def build(live) -> dict[str, Any]:
    original = live[PROCESS_WEIGHTS.key].function
    failure = "hybrid-exl3-fixes: P8 could not measure %s; it keeps aphrodite's own kernel choice"
    return {PROCESS_WEIGHTS.key: after_loading("P8", original, plan_layer, failure, "prefix")}


def plan_layer(method, layer, measure=None, device=None) -> dict:
    """Choose the launch of each of this layer's <= 32-row ``exl3_gemm`` shards; returns {shard: choice} for the
    shards routed away from the native launch at some row count. ``measure(trellis, suh, svh, codebook, launches)``
    returns ``times[rows][launch]`` in µs (default: this GPU's, ``measure_launches``)."""
    shards = p8_shards(layer)
    if not shards:
        return {}
    first = layer.trellis.exl3_tensors[shards[0]]
    if device is None:
        device = _device_facts(first.device)
    index, cc, sms = device
    measure = measure or measure_launches
    chosen = {}
    for shard in shards:
        trellis = layer.trellis.exl3_tensors[shard]
        k, n, K = kernels.gemm_key(tuple(trellis.shape))
        cb = codebook_of(layer, shard)
        key = (index, k, n, K, cb)
        if key not in CHOICES:
            launches = choice.candidates(cc, k, n, K, sms)
            times = (
                measure(trellis, layer.suh.exl3_tensors[shard], layer.svh.exl3_tensors[shard], cb, launches)
                if launches
                else {}
            )
            CHOICES[key] = (choice.decide(times), times)
            logger.info(
                "hybrid-exl3-fixes: P8 on cuda:%d: EXL3 %d -> %d (%d bits, %s) at <= 32 rows: %s",
                index,
                k,
                n,
                K,
                cb,
                choice.describe(CHOICES[key][0], times) if times else "no uncached launch tiles it; native kept",
            )
        picked = CHOICES[key][0]
        if choice.routes_anything(picked):
            chosen[shard] = picked
    if chosen:
        chosen_linear()  # registered now: torch.compile cannot trace an op's registration at the first call
        previous = vars(method).get("_apply_one")
        _CHANGED.append((method, layer, previous))
        # per shard the op's three step lists (max_rows, shapes, sms), made once here rather than at every call
        layer.hxf_exl3_chosen = {shard: [list(column) for column in zip(*steps)] for shard, steps in chosen.items()}
        method._apply_one = types.MethodType(_chosen_apply_one, method)
    return chosen


def p8_shards(layer) -> list:
    """The shards whose <= 32-row calls go through ``Exl3LinearMethod._apply_one`` to aphrodite's cached
    ``exl3_gemm``: none of a fused gate/up or q/k/v (aphrodite's ``exl3_gate_up`` / ``exl3_qkv`` ops run them, q
    inside the op), none that P3 routes around the cache."""
    if getattr(layer, "exl3_can_mgemm", False):
        return []
    routes = getattr(layer, "hxf_exl3_routes", None) or {}
    return [s for s in layer.exl3_shard_ids if s not in routes]


def _device_facts(device) -> tuple[int, str, int]:
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return index, kernels.compute_class(props.major, props.minor), props.multi_processor_count


def _chosen_apply_one(self, layer, x, shard_id):
    steps = layer.hxf_exl3_chosen.get(shard_id)
    if steps is None:
        if shard_id in (getattr(layer, "hxf_exl3_routes", None) or {}):
            return _routed_apply_one(self, layer, x, shard_id)
        return type(self)._apply_one(self, layer, x, shard_id)
    return chosen_linear()(x, *shard_operands(layer, shard_id), *steps)


_CHOSEN_OP = None


def chosen_linear():
    """``hybrid_exl3_fixes::exl3_linear_chosen``: aphrodite's ``_exl3_linear_one`` with the <= 32-row launch taken
    from the layer's choice (``max_rows``, ``shapes``, ``sms``: the first step with rows <= max_rows; shape -1 is
    aphrodite's own launch); more rows take aphrodite's own op (reconstruct + GEMM)."""
    global _CHOSEN_OP
    if _CHOSEN_OP is not None:
        return _CHOSEN_OP
    import torch
    from aphrodite import _custom_ops as ops

    def exl3_linear_chosen(x, trellis, suh, svh, mcg, mul1, max_rows, shapes, sms):
        rows = x.shape[0]
        if rows > kernels.SMALL_BATCH_ROWS:
            return torch.ops.aphrodite.exl3_linear_one(x, trellis, suh, svh, mcg, mul1)
        shape_idx, num_sms = choice.NATIVE, 0
        for limit, s, m in zip(max_rows, shapes, sms):
            if rows <= limit:
                shape_idx, num_sms = s, m
                break
        output = torch.empty((rows, trellis.shape[1] * 16), device=x.device, dtype=torch.float16)
        x_had = torch.empty_like(x)
        # (NATIVE, 0) is aphrodite's own arguments: the table's launch
        ops.exl3_gemm(x, trellis, output, suh, x_had, svh, shape_idx, mcg, mul1, num_sms)
        return output

    op = torch.library.custom_op(
        "hybrid_exl3_fixes::exl3_linear_chosen",
        exl3_linear_chosen,
        mutates_args=(),
        device_types="cuda",
        schema="(Tensor x, Tensor trellis, Tensor suh, Tensor svh, bool mcg, bool mul1, int[] max_rows, "
        "int[] shapes, int[] sms) -> Tensor",
    )

    @op.register_fake
    def _(x, trellis, suh, svh, mcg, mul1, max_rows, shapes, sms):
        return x.new_empty((x.shape[0], trellis.shape[1] * 16), dtype=torch.float16)

    _CHOSEN_OP = op
    return op


def measure_launches(trellis, suh, svh, codebook, launches, native=True) -> dict[int, dict[choice.Launch, float]]:
    """Time ``launches`` (and the native launch when ``native``) on this layer's own weights at each row count of
    ``choice.ROW_STEPS``: warm-up calls, then ``ROUNDS`` rounds of ``CALLS`` calls each between CUDA events, the
    launches interleaved (the order reversed every round), the median per launch in µs. A forced launch whose
    output is not the reconstruct path's (relative error >= kernels.SAME at that row count) is left out."""
    import aphrodite.model_executor.layers.quantization.exl3  # noqa: F401 - registers aphrodite::exl3_linear_one
    import torch

    mcg, mul1 = CODEBOOK_FLAGS[codebook]
    linear = torch.ops.aphrodite.exl3_linear_one
    routed = routed_linear()
    k = trellis.shape[0] * 16
    gen = torch.Generator(device=trellis.device).manual_seed(0)
    x_all = torch.randn(kernels.SMALL_BATCH_ROWS + 1, k, generator=gen, device=trellis.device).to(torch.float16)
    reference = linear(x_all, trellis, suh, svh, mcg, mul1).float()  # > 32 rows: reconstruct + GEMM
    times: dict[int, dict[choice.Launch, float]] = {}
    for rows in choice.ROW_STEPS:
        x = x_all[:rows].contiguous()
        ref = reference[:rows]
        fns = {}
        if native:
            fns[(choice.NATIVE, 0)] = lambda x=x: linear(x, trellis, suh, svh, mcg, mul1)
        for launch in launches:

            def fn(x=x, s=launch[0], m=launch[1]):
                return routed(x, trellis, suh, svh, mcg, mul1, s, m)

            out = fn().float()
            if float((out - ref).norm() / ref.norm().clamp_min(1e-30)) < kernels.SAME:
                fns[launch] = fn
        times[rows] = _time(fns, torch)
    return times


def _time(fns: dict, torch) -> dict:
    return time_interleaved(fns, torch, ROUNDS, CALLS, WARMUP)


PATCH = Patch(
    id="P8",
    slug="exl3-small-batch-kernel-choice",
    title="EXL3 <= 32-row GEMM: the kernel launch measured per layer at load instead of the sample tables' guess",
    upstream="docs/upstream/exl3-small-batch-kernel-choice.md (not reported upstream)",
    fixed_in="0.24.0",
    retire_when="the oldest supported aphrodite-engine is 0.24.x",
    targets=(PROCESS_WEIGHTS,),
    probe=probe_table_kernel_choice,
    build=build,
    on_undo=reset_state,
    checks_tag_after_apply=True,
    after=(
        "P3",
    ),  # P3 first: P8 chooses launches only for the shards P3 leaves on aphrodite's path, wrapping P3's loader
    symptom="speed: up to 32 EXL3 rows take the sample tables' GEMM launch; each layer's is measured at load",
)
