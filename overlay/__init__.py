"""hybrid-exl3-fixes: runtime overlay for Aphrodite 0.20.0-0.24.1 (EXL3 + LoRA on Qwen3.5/3.6 hybrids).

Aphrodite calls :func:`register` through the ``aphrodite.general_plugins`` entry point once in
every process it starts (process 0, engine core, each worker, the model-inspection subprocess).
:func:`register` never raises: aphrodite does not catch errors from a plugin's function.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import subprocess
import sys

from .aphrodite import _custom_ops as p14
from .aphrodite.lora import utils as p11
from .aphrodite.lora.layers import base_linear as p2b
from .aphrodite.lora.layers import fused_moe as p5
from .aphrodite.lora.layers import utils as p2
from .aphrodite.model_executor.layers.fused_moe.runner import shared_experts as p6
from .aphrodite.model_executor.layers.quantization.exl3 import (
    p1_shard_ids,
    p3_gemm_cache,
    p4_fp16_cat,
    p7_moe_graph,
    p8_kernel_choice,
    p9_moe_padding,
    p10_moe_context,
    p12_mid_batch,
    p13_moe_expert_lora,
    p16_moe_small_batch,
)
from .aphrodite.v1.worker import gpu_model_runner as p15
from .registry import DISABLE_ENV, Patch, Registry, Result, Status, in_apply_order, logger, patch_number

__all__ = [
    "PATCHES",
    "REGISTRY",
    "apply_all",
    "undo_all",
    "status",
    "status_report",
    "summary",
    "register",
    "plugin_gate",
    "off_switch_warning",
    "DISABLE_ENV",
    "PLUGIN_NAME",
]

PLUGIN_NAME = "hybrid_exl3_fixes"

# every patch module's PATCH, in patch-id order; applied in that order but where a patch's ``after`` says otherwise
PATCHES: list[Patch] = in_apply_order(
    [
        module.PATCH
        for module in (
            p1_shard_ids,
            p2,
            p2b,
            p3_gemm_cache,
            p4_fp16_cat,
            p5,
            p6,
            p7_moe_graph,
            p8_kernel_choice,
            p9_moe_padding,
            p10_moe_context,
            p11,
            p12_mid_batch,
            p13_moe_expert_lora,
            p14,
            p15,
            p16_moe_small_batch,
        )
    ]
)
REGISTRY = Registry(PATCHES)


def apply_all() -> list[Result]:
    """Apply every patch whose probe finds the bug; idempotent. Returns one result per patch."""
    return [REGISTRY.apply(patch) for patch in PATCHES]


def undo_all() -> list[str]:
    """Restore every original this process replaced, newest first; returns the undone ids."""
    return REGISTRY.undo_all()


def status() -> list[Result]:
    """The results of this process (applying first when nothing ran yet)."""
    if len(REGISTRY.results) < len(PATCHES):
        apply_all()
    return [REGISTRY.results[patch.id] for patch in PATCHES]


_REPORTS: dict[tuple, dict] = {}


def status_report(timeout: float = 600) -> dict:
    """What ``hybrid-exl3-fixes status --json`` answers in a fresh process: the patches as each process aphrodite
    starts will see them (``summary``, ``plugin_gate``, ``patches`` as ``Result.as_dict``). Read-only for the
    caller: nothing is imported or patched here. Cached per process for the environment that decides the answer
    (the off switch, APHRODITE_PLUGINS, PYTHONPATH). Raises RuntimeError when the child gives no report."""
    key = tuple(os.environ.get(k) for k in (DISABLE_ENV, "APHRODITE_PLUGINS", "PYTHONPATH"))
    if key not in _REPORTS:
        env = dict(os.environ, APHRODITE_LOGGING_LEVEL=os.environ.get("APHRODITE_LOGGING_LEVEL", "ERROR"))
        proc = subprocess.run(
            [sys.executable, "-m", "hybrid_exl3_fixes.cli", "status", "--json"],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        try:
            _REPORTS[key] = json.loads(proc.stdout)
        except json.JSONDecodeError:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            raise RuntimeError(f"`hybrid-exl3-fixes status --json` gave no report: {tail[0]}") from None
    return _REPORTS[key]


def aphrodite_version() -> str | None:
    try:
        return importlib.metadata.version("aphrodite-engine")
    except importlib.metadata.PackageNotFoundError:
        try:
            import aphrodite

            return getattr(aphrodite, "__version__", "unknown")
        except Exception:
            return None


def summary(results: list[Result]) -> str:
    counts = {s: sum(r.status is s for r in results) for s in Status}
    line = (
        f"hybrid-exl3-fixes: applied={counts[Status.APPLIED]} upstream_fixed={counts[Status.UPSTREAM_FIXED]} "
        f"drifted={counts[Status.DRIFTED]}"
    )
    extra = [
        f"{s.value.lower()}={counts[s]}"
        for s in (Status.NOT_APPLICABLE, Status.DISABLED, Status.FAILED, Status.BROKEN_INSTALL)
        if counts[s]
    ]
    if extra:
        line += " " + " ".join(extra)
    version = aphrodite_version()
    return line + (f" (aphrodite {version})" if version else " (aphrodite not installed)")


def off_switch_warning() -> str | None:
    """What is wrong with the off switch, or None: the entries of HYBRID_EXL3_FIXES_DISABLE that name no patch, and
    the ids that exist. Said in the engine's log (:func:`register`) and by ``status``; nothing else changes."""
    unknown = REGISTRY.unknown_disabled()
    if not unknown:
        return None
    ids = sorted((p.id for p in PATCHES), key=patch_number)
    return (
        f"{DISABLE_ENV} names no patch: {', '.join(repr(u) for u in unknown)}; nothing was switched off for "
        f"{'it' if len(unknown) == 1 else 'them'}. The ids: {','.join(ids)} (separated by commas), or 1 for all"
    )


def plugin_gate() -> str | None:
    """Why aphrodite would not load this plugin in its processes, or None when it would."""
    names = {ep.name for ep in importlib.metadata.entry_points(group="aphrodite.general_plugins")}
    if PLUGIN_NAME not in names:
        return "the aphrodite.general_plugins entry point is not installed (pip install hybrid-exl3-fixes)"
    allowed = os.environ.get("APHRODITE_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in [p.strip() for p in allowed.split(",")]:
        return f"APHRODITE_PLUGINS={allowed!r} does not name {PLUGIN_NAME}, so aphrodite skips it"
    return None


def register() -> None:
    """The plugin entry point: apply, log one summary line, warn for each patch not applied."""
    try:
        results = apply_all()
        for result in results:
            if result.is_problem:
                logger.warning(
                    "hybrid-exl3-fixes: %s %s %s: %s. The engine runs unpatched for this fix; "
                    "report it with `hybrid-exl3-fixes status --json`.",
                    result.patch.id,
                    result.patch.slug,
                    result.status.value,
                    result.reason,
                )
            elif result.status is Status.UPSTREAM_FIXED:
                logger.info(
                    "hybrid-exl3-fixes: %s %s is fixed upstream (%s); not patched.",
                    result.patch.id,
                    result.patch.slug,
                    result.patch.upstream,
                )
        switch = off_switch_warning()
        worst = any(r.is_problem for r in results) or switch
        logger.log(logging.WARNING if worst else logging.INFO, "%s", summary(results))
        if switch:
            logger.warning("hybrid-exl3-fixes: %s", switch)
    except Exception:  # pragma: no cover - the last line of defence for the engine
        logger.exception("hybrid-exl3-fixes: unexpected error; the engine runs unpatched")
