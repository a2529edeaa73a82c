"""What the EXL3 patches share: the module they patch and the parsed source of a live function."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable

from hybrid_exl3_fixes.registry import Drift, logger, tag

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
