"""P12: EXL3 linear layers at 16 - 256 rows take the path measured fastest per layer at load, instead of the tiled
GEMM up to a fixed 144 rows; an opt-in keeps float16 weights for the layers a memory budget allows.

Target: ``aphrodite/model_executor/layers/quantization/exl3.py`` (0.24+).

Why:     0.24.0 raised ``_EXL3_AUTO_RECONSTRUCT_THRESHOLD`` from 32 to 144 (exllamav3 1.6.5's
         ``AUTO_RECONSTRUCT_THRESHOLD``): ``_exl3_linear_one``, ``_exl3_gate_up`` and ``_exl3_qkv`` send up to 144
         rows to the tiled EXL3 GEMM, whose time grows with each 16-row tile, and rebuild the float16 weight only
         above. Where the rebuild is cheaper than the tiles (a GPU with high memory bandwidth: the rebuild writes and
         reads the float16 weight once, the tiles decode the trellis once per 16 rows) every step of 33 - 144
         sequences pays the difference (docs/upstream/exl3-mid-batch-rebuild.md).
How:     after the original ``process_weights_after_loading``, each EXL3 linear layer is timed on its own weights,
         once per shape in the process, at ``midbatch.ROW_STEPS``: aphrodite's path, the rebuild (aphrodite's own
         code with the threshold lowered for the call) and, opted in by ``HYBRID_EXL3_FIXES_EXL3_KEEP=GIB|all``
         while the budget lasts, one GEMM on a kept float16 weight (``W = apply(I)``, so ``x @ W`` is what the layer
         computes). A call takes, at its row count, the fastest path where it beats aphrodite's by more than 3 %.
         The three ops' CUDA kernels are replaced through ``CustomOpDef.register_kernel``, so torch.compile and
         CUDA graphs see the same ops; a routed call lowers the module's threshold for its own duration (the model
         runs in one thread), and entries are keyed by the op and its first weight tensor, so a call the layer does
         not make, or a nested call inside a fused op, keeps what the outer call chose. Each measured shape is
         logged at INFO with its times; a failing measurement keeps aphrodite's path and is logged.
Probe:   opted in (``HYBRID_EXL3_FIXES_MID_BATCH=1``, or the keep opt-in: P12 stays an opt-in until a GPU run has
         measured it end to end), the module has the threshold (0.24+; 0.20 - 0.23 rebuild above 32 rows, two
         tiles: NOT_APPLICABLE) and the three ops are custom ops whose kernel can be replaced (else DRIFTED); an
         invalid keep value makes P12 NOT_APPLICABLE with the reason, changing nothing.
Upstream: not reported yet; the write-up above has the report and the minimal fix (measure the crossover per shape,
         or lower the threshold on high-bandwidth GPUs).
Retire when: aphrodite chooses the EXL3 path per shape and row count by measurement.
"""

from __future__ import annotations

import importlib
import inspect
import os
import threading
from typing import Any

from hybrid_exl3_fixes.decisions import p12_mid_batch as midbatch
from hybrid_exl3_fixes.registry import Drift, NotApplicable, Patch, logger, tags_of
from hybrid_exl3_fixes.shared import MODULE, PROCESS_WEIGHTS, after_loading, time_interleaved

APHRODITE_OPS = ("_exl3_linear_one", "_exl3_gate_up", "_exl3_qkv")
THRESHOLD = "_EXL3_AUTO_RECONSTRUCT_THRESHOLD"
CHUNK = 2048  # identity rows per call when a kept weight is made
ROUNDS, CALLS, WARMUP = 5, 4, 2

# (op name, first weight tensor's data_ptr) -> (steps, kept weight columns or None); read by the replaced kernels
ENTRIES: dict[tuple[str, int], tuple[midbatch.Steps, Any]] = {}
# (device index, the layer's shapes and codebooks, kept or not) -> (steps, times): measured once per process
TIMES: dict[tuple, tuple[midbatch.Steps, dict]] = {}
BUDGETS: dict[int, midbatch.Budget] = {}  # per device index
_WRAPPED: dict[str, Any] = {}  # op name -> its CustomOpDef, whose kernel P12 replaced
_LOCAL = threading.local()  # depth of nested EXL3 op calls, and the recorder of the top-level ones


def reset_state() -> None:
    """P12's undo of what it did at load time: every op gets back its kernel, every entry and kept weight is dropped."""
    for opdef in _WRAPPED.values():
        opdef.register_kernel("cuda")(opdef._init_fn)
    _WRAPPED.clear()
    ENTRIES.clear()
    TIMES.clear()
    BUDGETS.clear()


def probe_fixed_threshold(live) -> bool:
    """True = the fixed threshold is there and P12 is not."""
    if not midbatch.enabled(os.environ):
        raise NotApplicable(
            f"an opt-in until measured end to end: set {midbatch.ENABLE_ENV}=1 (or {midbatch.KEEP_ENV}=GIB|all) to "
            "choose the EXL3 path at 16 - 256 rows by measurement"
        )
    try:
        midbatch.keep_budget(os.environ)
    except midbatch.KeepSettingError as exc:
        raise NotApplicable(f"{exc}; P12 stays off") from exc
    exl3 = importlib.import_module(MODULE)
    threshold = getattr(exl3, THRESHOLD, None)
    if threshold is None:
        raise NotApplicable(
            "this release sends <= 32 rows (two GEMM tiles) to the EXL3 GEMM and rebuilds above; the 144-row "
            "threshold P12 measures against came in 0.24.0"
        )
    if not isinstance(threshold, int):
        raise Drift(f"{MODULE}.{THRESHOLD} is {threshold!r}, not a row count")
    for name in APHRODITE_OPS:
        op = getattr(exl3, name, None)
        if not callable(getattr(op, "register_kernel", None)) or not callable(getattr(op, "_init_fn", None)):
            raise Drift(f"{MODULE}.{name} is not a torch custom op whose kernel can be replaced")
    return "P12" not in tags_of(live[PROCESS_WEIGHTS.key].raw)


def build(live) -> dict[str, Any]:
    original = live[PROCESS_WEIGHTS.key].function
    failure = "hybrid-exl3-fixes: P12 could not measure %s; it keeps aphrodite's path"
    return {PROCESS_WEIGHTS.key: after_loading("P12", original, plan_layer, failure, "prefix")}


def plan_layer(method, layer, measure=None) -> midbatch.Steps:
    """Measure this layer's paths (once per shape) and register its entries; returns its steps (all native where
    nothing is routed). ``measure(method, layer, weight)`` returns ``{rows: {path: µs}}`` (default: this GPU's,
    ``measure_paths``)."""
    import torch

    first = next(iter(layer.trellis.exl3_tensors.values()))
    if first.device.type != "cuda":
        return ()
    index = first.device.index if first.device.index is not None else torch.cuda.current_device()
    wrap_ops()
    calls = record_calls(method, layer, first)
    in_features, out_features = first.shape[0] * 16, sum(cols for _, _, cols in calls)
    name = getattr(layer, "prefix", type(layer).__name__)
    weight, nbytes = None, midbatch.layer_bytes(in_features, out_features)
    limit = midbatch.keep_budget(os.environ)
    if limit is not None:
        budget = BUDGETS.setdefault(index, midbatch.Budget(limit))
        if budget.take(nbytes):
            weight = effective_weight(method, layer, in_features, out_features, first.device)
        else:
            logger.info(
                "hybrid-exl3-fixes: P12: %s (%d -> %d) is over the keep budget",
                name,
                in_features,
                out_features,
            )
    key = (
        index,
        weight is not None,
        *sorted((str(n), tuple(t.shape)) for n, t in layer.trellis.exl3_tensors.items()),
        *sorted(map(str, layer.mcg.exl3_tensors)),
        *sorted(map(str, layer.mul1.exl3_tensors)),
    )
    if key not in TIMES:
        times = (measure or measure_paths)(method, layer, weight)
        TIMES[key] = (midbatch.decide(times), times)
        logger.info(
            "hybrid-exl3-fixes: P12 on cuda:%d: EXL3 %d -> %d (%s%s): %s",
            index,
            in_features,
            out_features,
            ", ".join(op.lstrip("_") for op, _, _ in calls),
            ", kept" if weight is not None else "",
            midbatch.describe(*TIMES[key]),
        )
    steps = TIMES[key][0]
    if weight is not None and not midbatch.keeps(steps):
        BUDGETS[index].give_back(nbytes)
        weight = None
    if not midbatch.routes_anything(steps):
        return steps
    start = 0
    for op, ptr, cols in calls:
        ENTRIES[(op, ptr)] = (steps, None if weight is None else weight[:, start : start + cols])
        start += cols
    return steps


def wrap_ops() -> None:
    """Replace the CUDA kernel of aphrodite's three EXL3 ops (once each) with ``_kernel``'s router."""
    exl3 = importlib.import_module(MODULE)
    for name in APHRODITE_OPS:
        if name in _WRAPPED:
            continue
        opdef = getattr(exl3, name)
        _WRAPPED[name] = opdef
        opdef.register_kernel("cuda")(_kernel(name, opdef._init_fn))


def route(name: str, original, x, first, rest):
    """One call of op ``name``: at the outermost EXL3 op call the layer's entry picks the path for ``x``'s rows
    (kept: ``x @ W``; rebuild: ``original`` with the module's threshold lowered for the call; native or no entry:
    ``original``); nested calls run ``original`` under what the outer call set. Top-level calls are recorded while
    ``record_calls`` listens."""
    depth = getattr(_LOCAL, "depth", 0)
    lowered = None
    if depth == 0:
        entry = ENTRIES.get((name, first.data_ptr()))
        if entry is not None:
            path = midbatch.path_for(entry[0], x.shape[0])
            if path == midbatch.KEPT and entry[1] is not None:
                return x @ entry[1]
            if path == midbatch.REBUILD:
                lowered = importlib.import_module(MODULE)
    _LOCAL.depth = depth + 1
    saved = None
    if lowered is not None:
        saved = getattr(lowered, THRESHOLD)
        setattr(lowered, THRESHOLD, 0)
    try:
        out = original(x, first, *rest)
    finally:
        _LOCAL.depth = depth
        if lowered is not None:
            setattr(lowered, THRESHOLD, saved)
    recorder = getattr(_LOCAL, "recorder", None)
    if depth == 0 and recorder is not None:
        recorder.append((name, first.data_ptr(), out.shape[-1]))
    return out


def _kernel(name: str, original):
    signature = inspect.signature(original)

    def kernel(*args, **kwargs):
        if kwargs:  # the dispatcher passes the schema's arguments positionally; a keyword call is bound in order
            args = signature.bind(*args, **kwargs).args
        return route(name, original, args[0], args[1], args[2:])

    kernel.__name__ = f"hxf_p12{name}"
    return kernel


def record_calls(method, layer, first) -> list[tuple[str, int, int]]:
    """The top-level EXL3 op calls the layer's ``apply`` makes for one row, in output order: (op, first weight
    tensor's data_ptr, output columns)."""
    import torch

    _LOCAL.recorder = []
    try:
        method.apply(layer, torch.zeros(1, first.shape[0] * 16, dtype=torch.float16, device=first.device))
        return list(_LOCAL.recorder)
    finally:
        _LOCAL.recorder = None


def effective_weight(method, layer, in_features: int, out_features: int, device):
    """``W`` (in x out, float16) with ``x @ W`` the layer's answer: the layer applied to the identity, in chunks."""
    import torch

    weight = torch.empty(in_features, out_features, dtype=torch.float16, device=device)
    for start in range(0, in_features, CHUNK):
        stop = min(start + CHUNK, in_features)
        eye = torch.zeros(stop - start, in_features, dtype=torch.float16, device=device)
        diagonal = torch.arange(stop - start, device=device)
        eye[diagonal, diagonal + start] = 1
        weight[start:stop] = method.apply(layer, eye)
    return weight


class forced_rebuild:
    """Within it, aphrodite's EXL3 ops rebuild the float16 weight at every row count (the threshold set to 0)."""

    def __enter__(self):
        self.module = importlib.import_module(MODULE)
        self.saved = getattr(self.module, THRESHOLD)
        setattr(self.module, THRESHOLD, 0)

    def __exit__(self, *exc):
        setattr(self.module, THRESHOLD, self.saved)


def measure_paths(method, layer, weight) -> dict[int, dict[str, float]]:
    """Each path at each of ``midbatch.ROW_STEPS`` on this layer (kept only with a ``weight``): CUDA events,
    ``ROUNDS`` rounds of ``CALLS`` calls after ``WARMUP``, the paths interleaved (order reversed every round),
    medians in µs. Measured before the layer has an entry, so ``apply`` is aphrodite's own path."""
    import torch

    in_features = next(iter(layer.trellis.exl3_tensors.values())).shape[0] * 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    x_all = torch.randn(max(midbatch.ROW_STEPS), in_features, generator=gen, device="cuda").to(torch.float16)

    def rebuilt(x):
        with forced_rebuild():
            return method.apply(layer, x)

    out = {}
    for rows in midbatch.ROW_STEPS:
        x = x_all[:rows].contiguous()
        fns = {midbatch.NATIVE: lambda x=x: method.apply(layer, x), midbatch.REBUILD: lambda x=x: rebuilt(x)}
        if weight is not None:
            fns[midbatch.KEPT] = lambda x=x: x @ weight
        out[rows] = _time(fns, torch)
    return out


def _time(fns: dict, torch) -> dict:
    return time_interleaved(fns, torch, ROUNDS, CALLS, WARMUP)


PATCH = Patch(
    id="P12",
    slug="exl3-mid-batch-rebuild",
    title="EXL3 linear layers at 16 - 256 rows: the tiled GEMM, the rebuild or a kept float16 weight, measured per "
    "layer at load instead of a fixed 144-row threshold",
    upstream="docs/upstream/exl3-mid-batch-rebuild.md (not reported upstream)",
    fixed_in=None,
    retire_when="aphrodite chooses the EXL3 path per shape and row count by measurement",
    targets=(PROCESS_WEIGHTS,),
    probe=probe_fixed_threshold,
    build=build,
    on_undo=reset_state,
    checks_tag_after_apply=True,
    after=("P3", "P8"),  # P3 and P8 first (0.20 - 0.23): P12 wraps the loader they installed
    symptom="speed: 16 - 256 EXL3 rows take the tiled GEMM where rebuilding the weight is faster; each layer is "
    "measured at load",
    opt_in="HYBRID_EXL3_FIXES_MID_BATCH",
)
