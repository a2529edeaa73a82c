"""P12's decisions, torch-free: which path an EXL3 linear layer takes for a call of 16 - 256 rows, from measured times,
and how much memory the opt-in float16 weights may take.

aphrodite 0.24+ sends up to ``_EXL3_AUTO_RECONSTRUCT_THRESHOLD`` (144) rows to the tiled EXL3 GEMM, whose time grows
with every 16-row tile, and rebuilds the float16 weight above (docs/upstream/exl3-mid-batch-rebuild.md). Three paths
answer a call:

    native   aphrodite's own (the tiled GEMM up to the threshold, the rebuild above)
    rebuild  the float16 weight rebuilt for the call and one GEMM on it (aphrodite's own code above the threshold)
    kept     one GEMM on a float16 weight kept from load: an opt-in that costs ``2 x in x out`` bytes a layer,
             ``HYBRID_EXL3_FIXES_EXL3_KEEP=GIB`` (per GPU) or ``all``

Each layer shape is timed on the three (kept only when opted in and within the budget) at ``ROW_STEPS``; a call of
``rows`` rows takes the step ``>= rows`` (the last step above it) and that step's path: the fastest one where it beats
native by more than ``MARGIN``, else native.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from hybrid_exl3_fixes.registry import opted_in

KEEP_ENV = "HYBRID_EXL3_FIXES_EXL3_KEEP"
# P12 itself is an opt-in until a GPU run has measured it end to end (docs/upstream/exl3-mid-batch-rebuild.md)
ENABLE_ENV = "HYBRID_EXL3_FIXES_MID_BATCH"


def enabled(environ: Mapping[str, str]) -> bool:
    """P12 on: ``HYBRID_EXL3_FIXES_MID_BATCH=1`` (or true / on / yes), or the keep opt-in set at all."""
    return opted_in(environ, ENABLE_ENV) or bool((environ.get(KEEP_ENV) or "").strip())


NATIVE, REBUILD, KEPT = "native", "rebuild", "kept"
PATHS = (NATIVE, REBUILD, KEPT)
# 16-row tiles up to 0.24's threshold (each step is where the tiled GEMM adds a tile), then the rebuild's range
ROW_STEPS = (1, 8, 16, 32, 48, 64, 80, 96, 112, 128, 144, 192, 256)
MARGIN = 0.03  # another path must be this much faster than native at a step to be taken there

Steps = tuple[tuple[int, str], ...]  # ((max_rows, path), ...), ascending max_rows


class KeepSettingError(ValueError):
    """The opt-in's value is neither a positive number of GiB nor ``all``; the message says what was given."""


def keep_budget(environ: Mapping[str, str]) -> int | None:
    """The kept weights' budget in bytes per GPU from ``HYBRID_EXL3_FIXES_EXL3_KEEP``: None when unset or empty (off),
    ``-1`` for ``all`` (no limit); ``KeepSettingError`` for any other value."""
    raw = (environ.get(KEEP_ENV) or "").strip()
    if not raw:
        return None
    if raw.lower() == "all":
        return -1
    try:
        gib = float(raw)
    except ValueError:
        gib = math.nan
    if not math.isfinite(gib) or gib <= 0:
        raise KeepSettingError(
            f"{KEEP_ENV}={raw!r}: give the kept float16 weights' size in GiB per GPU (a positive number, e.g. 8) "
            "or 'all'"
        )
    return int(gib * 2**30)


def describe_budget(budget: int | None) -> str:
    if budget is None:
        return "off"
    return "every EXL3 linear layer" if budget < 0 else f"{budget / 2**30:g} GiB per GPU"


def decide(times: Mapping[int, Mapping[str, float]], margin: float = MARGIN) -> Steps:
    """The steps from ``times[rows][path]`` (µs, any statistic, the same for every path). A step where native was
    not timed, or nothing was, keeps native."""
    steps = []
    for rows in ROW_STEPS:
        at = times.get(rows) or {}
        native = at.get(NATIVE)
        pick = NATIVE
        others = {p: t for p, t in at.items() if p != NATIVE}
        if native is not None and others:
            best = min(others, key=others.get)
            if others[best] < native * (1.0 - margin):
                pick = best
        steps.append((rows, pick))
    return tuple(steps)


def path_for(steps: Steps, rows: int) -> str:
    """The path ``steps`` takes for ``rows`` rows: the first step with ``rows <= max_rows``; the last one above."""
    for max_rows, path in steps:
        if rows <= max_rows:
            return path
    return steps[-1][1] if steps else NATIVE


def routes_anything(steps: Steps) -> bool:
    return any(path != NATIVE for _, path in steps)


def keeps(steps: Steps) -> bool:
    return any(path == KEPT for _, path in steps)


def describe(steps: Steps, times: Mapping[int, Mapping[str, float]]) -> str:
    """One line: per step the path taken and the times (µs) of native / rebuild / kept."""
    parts = []
    for rows, path in steps:
        at = times.get(rows) or {}
        measured = "/".join(f"{at[p]:.0f}" if p in at else "-" for p in PATHS)
        parts.append(f"{rows}: {path} ({measured})")
    return "; ".join(parts) + " us native/rebuild/kept"


def saving(steps: Steps, times: Mapping[int, Mapping[str, float]]) -> dict[int, float]:
    """Per step the fraction of native's time the chosen path saves (0 where native is kept)."""
    out = {}
    for rows, path in steps:
        at = times.get(rows) or {}
        native = at.get(NATIVE)
        out[rows] = 0.0 if path == NATIVE or not native else 1.0 - at[path] / native
    return out


class Budget:
    """The bytes left in the kept weights' budget on one GPU; ``take`` reserves a layer's weight if it fits."""

    def __init__(self, limit: int):
        self.limit = limit  # -1: no limit
        self.used = 0

    def take(self, nbytes: int) -> bool:
        if self.limit >= 0 and self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def give_back(self, nbytes: int) -> None:
        self.used = max(0, self.used - nbytes)


def layer_bytes(in_features: int, out_features: int) -> int:
    """A kept weight: float16, ``in x out``."""
    return 2 * in_features * out_features
