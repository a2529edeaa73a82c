"""P8's decision, torch-free: which launch of the <= 32-row EXL3 GEMM a layer takes, from measured times.

aphrodite 0.20 - 0.23 send <= 32 rows to ``ops.exl3_gemm`` with ``force_shape_idx = -1``: the kernel's tiling and
SM count come from the port's sample tables (the nearest sampled ``(k, n)`` for the device class and bitrate,
``select_exl3_gemm_mgemm_kernel_new`` in csrc/.../exl3_kernel_map.cu), whatever the row count. An uncached launch
(``force_shape_idx > 0``, ``force_num_sms > 0``) runs the tiling the caller names. Which one is faster depends on
the layer's shape, bitrate and row count, so P8 measures them at load and keeps a launch only where it beats the
native choice by more than ``MARGIN`` (docs/upstream/exl3-small-batch-kernel-choice.md).

A choice is a tuple of ``(max_rows, shape_idx, num_sms)`` steps in ascending ``max_rows``, the last one 32: a call
with ``rows`` rows takes the first step with ``rows <= max_rows``; ``shape_idx == NATIVE`` is aphrodite's own
launch. Every step was measured at its ``max_rows``.
"""

from __future__ import annotations

from collections.abc import Mapping

from .exl3_kernels import SMALL_BATCH_ROWS, TILE_K, TILE_N, forced_launch, shape_fits

ROW_STEPS = (1, 8, 16, SMALL_BATCH_ROWS)  # the row counts P8 measures; each covers the rows up to it
NATIVE = -1  # shape_idx of aphrodite's own (table) launch; its num_sms is 0
MARGIN = 0.03  # a forced launch must be this much faster than the native one to be taken

Launch = tuple[int, int]  # (shape_idx, num_sms); (NATIVE, 0) is the native launch
Choice = tuple[tuple[int, int, int], ...]  # ((max_rows, shape_idx, num_sms), ...)


def candidates(cc: str, k: int, n: int, K: int, device_sms: int) -> list[Launch]:
    """The uncached launches P8 times for a ``k x n`` layer of ``K`` bits: exllamav3's shape heuristic first (what
    P3 routes to), then every tiling shape that tiles the layer with one block per tile up to all SMs and up to half
    of them. Empty when no shape tiles it."""
    found: list[Launch] = []
    first = forced_launch(cc, k, n, K, device_sms)
    if first is None:
        return found
    found.append(first)
    for shape_idx in range(1, len(TILE_K)):
        if not shape_fits(shape_idx, k, n):
            continue
        slices = (k // TILE_K[shape_idx]) * (n // TILE_N[shape_idx])
        for sms in (device_sms, device_sms // 2):
            launch = (shape_idx, max(1, min(slices, sms)))
            if launch not in found:
                found.append(launch)
    return found


def decide(times: Mapping[int, Mapping[Launch, float]], margin: float = MARGIN) -> Choice:
    """The choice from ``times[rows][launch]`` (µs, any statistic, the same for every launch), for the row counts
    of ``ROW_STEPS``. At each step the fastest forced launch is taken where it is more than ``margin`` faster than
    the native one; where the native launch was not timed (a layer P3 keeps off the cached kernel) the fastest
    forced one is taken. A step with no time at all keeps the native launch."""
    steps = []
    for rows in ROW_STEPS:
        at = times.get(rows) or {}
        forced = {launch: t for launch, t in at.items() if launch[0] != NATIVE}
        native = at.get((NATIVE, 0))
        pick: Launch = (NATIVE, 0)
        if forced:
            best = min(forced, key=forced.get)
            if native is None or forced[best] < native * (1.0 - margin):
                pick = best
        steps.append((rows, *pick))
    return tuple(steps)


def launch_for(choice: Choice, rows: int) -> Launch:
    """The launch ``choice`` takes for a call of ``rows`` rows (1 <= rows <= 32)."""
    for max_rows, shape_idx, num_sms in choice:
        if rows <= max_rows:
            return shape_idx, num_sms
    return NATIVE, 0


def routes_anything(choice: Choice) -> bool:
    return any(shape_idx != NATIVE for _, shape_idx, _ in choice)


def saving(times: Mapping[int, Mapping[Launch, float]], choice: Choice) -> dict[int, float]:
    """µs saved per call at each measured row count against the native launch (0 where native was kept or not
    timed)."""
    out = {}
    for max_rows, shape_idx, num_sms in choice:
        at = times.get(max_rows) or {}
        native = at.get((NATIVE, 0))
        chosen = at.get((shape_idx, num_sms))
        out[max_rows] = (native - chosen) if native is not None and chosen is not None else 0.0
    return out


def describe(choice: Choice, times: Mapping[int, Mapping[Launch, float]]) -> str:
    """One line: for each step its launch and time against the native one's, e.g.
    ``1 row: 3/132 40.4 us (native 49.3)``."""
    parts = []
    for max_rows, shape_idx, num_sms in choice:
        at = times.get(max_rows) or {}
        native = at.get((NATIVE, 0))
        label = "native" if shape_idx == NATIVE else f"{shape_idx}/{num_sms}"
        took = at.get((shape_idx, num_sms))
        text = f"{max_rows} row{'s' if max_rows > 1 else ''}: {label}"
        if took is not None:
            text += f" {took:.1f} us"
        if shape_idx != NATIVE and native is not None:
            text += f" (native {native:.1f})"
        parts.append(text)
    return ", ".join(parts)
