"""Checks of the engine configuration against the installed aphrodite and the overlay: the compiled mode's
dtype, and EXL3 MoE (LoRA, CUDA graphs, the shared expert, padding ids, the release)."""

from __future__ import annotations

from .base import COMPILED_CRASH_DOC, Report
from .memory import arithmetic
from .shape import Shape, parse_config


def activation_dtype(shape: Shape, dtype: str = "auto") -> tuple[str, str]:
    """The dtype the engine computes in, and where it comes from: ``--dtype``, else the config's
    (aphrodite's ``auto``; a float32 or absent config dtype gives bfloat16 on a GPU that has it)."""
    if dtype != "auto":
        return arithmetic.canonical_dtype(dtype), f"--dtype {dtype}"
    declared = shape.declared_dtype
    if declared in ("bfloat16", "float16"):
        return declared, f"config.json dtype {declared}"
    return "bfloat16", f"config.json dtype {declared or 'not set'} (auto: bfloat16)"


def check_release(report: Report, version: str | None, named: bool) -> None:
    """A WARN where the plan is for a release outside the tested ones (overlay/compat.py TESTED_RELEASES): the
    patches, probes and memory terms were written and checked against those only."""
    from hybrid_exl3_fixes.compat import TESTED_RELEASES, is_tested

    if version is None or is_tested(version):
        return
    where = "--release" if named else "the installed aphrodite-engine"
    report.add(
        "WARN",
        "release",
        f"{where} is {version}, outside the releases this overlay is tested against ({TESTED_RELEASES[0]} - "
        f"{TESTED_RELEASES[-1]}): the patches may not apply, and the plan below "
        "follows the nearest tested release's arithmetic",
    )


def check_dtype(report: Report, shape: Shape, dtype: str, version: str | None) -> bool:
    """Whether the engine accepts the activation dtype for this checkpoint; a BLOCK where it does not. EXL3 serves
    only in the dtypes Exl3Config.get_supported_act_dtypes returns (overlay/compat.py EXL3_ACT_DTYPES, read from
    each release's exl3.py); the engine's config check refuses any other before it loads a weight."""
    from hybrid_exl3_fixes.compat import NEWEST_TESTED, exl3_act_dtypes

    if shape.quant.get("quant_method") != "exl3":
        return True
    act, source = activation_dtype(shape, dtype)
    allowed = exl3_act_dtypes(version)
    if act in allowed:
        return True
    report.add(
        "BLOCK",
        "dtype",
        f"{act} activations ({source}): aphrodite {version or NEWEST_TESTED} serves EXL3 only in "
        f"{' or '.join(allowed)} (Exl3Config.get_supported_act_dtypes) and refuses {act} at start-up "
        f'("torch.{act} is not supported for quantization method exl3"); serve with --dtype bfloat16 or leave '
        "--dtype at auto. No memory plan for a configuration the engine refuses.",
    )
    return False


MOE_LORA_DOC = "docs/upstream/exl3-moe-lora-device.md"


def is_exl3_moe(shape: Shape) -> bool:
    return bool(shape.moe) and shape.quant.get("quant_method") == "exl3"


def check_moe_lora(report: Report, shape: Shape, enable_lora: bool, p5_status: str | None) -> None:
    """EXL3 MoE + --enable-lora: every release 0.20.0-0.24.1 wraps the EXL3 MoE layers in FusedMoEWithLoRA,
    which needs a modular kernel Exl3MoEMethod lacks, and fails at start-up unless the overlay's P5 leaves them
    unwrapped (docs/upstream/exl3-moe-lora-device.md)."""
    if not (enable_lora and is_exl3_moe(shape)):
        return
    if p5_status in ("APPLIED", "UPSTREAM_FIXED"):
        report.add(
            "OK",
            "moe-lora",
            "EXL3 MoE with --enable-lora: the routed experts take no LoRA (Exl3MoEMethod has no LoRA kernel) and "
            "stay as they are; adapters on attention, GatedDeltaNet and shared-expert projections load; an adapter "
            f"that also targets mlp.experts is refused at load with the modules named (P5 {p5_status}; {MOE_LORA_DOC})",
        )
        return
    failure = (
        '"ValueError: Exl3MoEMethod uses the new modular kernel initialization logic" (0.20/0.21) or '
        '"RuntimeError: Old-style modular kernel not supported." (0.22-0.24.1)'
    )
    if p5_status in (None, "NOT_APPLICABLE"):
        report.add(
            "WARN",
            "moe-lora",
            f"EXL3 MoE with --enable-lora: aphrodite 0.20.0-0.24.1 stop at start-up with {failure}, whatever the "
            f"adapters target, unless this overlay is installed in that environment (P5; {MOE_LORA_DOC})",
        )
        return
    report.add(
        "BLOCK",
        "moe-lora",
        f"EXL3 MoE with --enable-lora and the overlay's P5 not active ({p5_status}): the engine stops at start-up "
        f"with {failure}. Let P5 run (unset HYBRID_EXL3_FIXES_DISABLE, allow the plugin) or serve without "
        f"--enable-lora ({MOE_LORA_DOC})",
    )


def without_fix(patch: str, status: str | None) -> str:
    """How a WARN says why the fix is missing: no overlay where the engine runs, or the patch not active."""
    if status in (None, "NOT_APPLICABLE"):
        return "unless this overlay is installed in that environment"
    return f"and the overlay's {patch} is not active ({status})"


MOE_GRAPH_DOC = "docs/upstream/exl3-moe-graph-expert-capacity.md"
MOE_STREAM_DOC = "docs/upstream/exl3-moe-shared-expert-stream.md"


def check_moe_graphs(report: Report, shape: Shape, enforce_eager: bool, p7_status: str | None) -> None:
    """EXL3 MoE in CUDA graphs (the default compiled mode): every release 0.20.0-0.24.1 leaves out any expert
    that gets more than 128 of a captured batch's tokens, so busy batches are answered wrongly; the overlay's P7
    chunks the captured batch. OK in eager mode or where P7 runs (docs/upstream/exl3-moe-graph-expert-capacity.md)."""
    if not is_exl3_moe(shape):
        return
    if enforce_eager:
        report.add("OK", "moe-graphs", "EXL3 MoE with --enforce-eager: no CUDA graphs, every expert is computed")
        return
    if p7_status in ("APPLIED", "UPSTREAM_FIXED"):
        report.add(
            "OK",
            "moe-graphs",
            "EXL3 MoE in the default compiled mode: the fused expert kernel skips an expert with more than 128 of "
            "a batch's tokens, which aphrodite recomputes outside CUDA graphs only; "
            + ("the overlay's P7 chunks captured batches here" if p7_status == "APPLIED" else "this aphrodite fixed it")
            + f" ({MOE_GRAPH_DOC})",
        )
        return
    where = without_fix("P7", p7_status)
    report.add(
        "WARN",
        "moe-graphs",
        f"EXL3 MoE in the default compiled mode, {where}: aphrodite 0.20.0-0.24.1 leave out every expert that gets "
        "more than 128 of a batch's tokens inside a CUDA graph (batches of 129-512 tokens by default), silently: "
        "measured 0.185 nats off the reference with 16 requests at once on a 4-expert model, and likelier the "
        "fewer experts a model has. Let P7 run, or serve with --enforce-eager (no CUDA graphs: slower) "
        f"({MOE_GRAPH_DOC})",
    )


def check_moe_stream(report: Report, shape: Shape, p6_status: str | None) -> None:
    """EXL3 MoE with a shared expert: since 0.21 aphrodite runs the shared expert on a second CUDA stream beside the
    routed experts for batches of <= 256 tokens, both EXL3 kernels on one lock array, and a server can stop
    answering; P6 keeps them on one stream, as 0.20.0 did (docs/upstream/exl3-moe-shared-expert-stream.md)."""
    if not (is_exl3_moe(shape) and (shape.moe or {}).get("shared_intermediate")):
        return
    if p6_status in ("APPLIED", "UPSTREAM_FIXED"):
        report.add(
            "OK",
            "moe-stream",
            "EXL3 MoE shared expert: "
            + ("the overlay's P6 keeps it on the main stream" if p6_status == "APPLIED" else "this aphrodite keeps it")
            + f" beside the routed experts' EXL3 kernels ({MOE_STREAM_DOC})",
        )
        return
    where = without_fix("P6", p6_status)
    report.add(
        "WARN",
        "moe-stream",
        f"EXL3 MoE with a shared expert, {where}: aphrodite 0.21-0.24.1 run the shared expert's EXL3 kernels on a "
        "second CUDA stream beside the routed experts' for batches of up to 256 tokens, and a server so served "
        "stopped answering on an H200 (its first completion never came; not every run). Let P6 run, or set "
        f"APHRODITE_DISABLE_SHARED_EXPERTS_STREAM=1 (for every MoE model in the process) ({MOE_STREAM_DOC})",
    )


MOE_PADDING_DOC = "docs/upstream/exl3-moe-padding-expert-ids.md"


def check_moe_padding(report: Report, shape: Shape, p9_status: str | None) -> None:
    """EXL3 MoE on 0.23+: the routers give the rows a batch is padded with (CUDA-graph sizes, the profiling run)
    expert id -1 (``APHRODITE_MOE_SKIP_PADDING``, on by default since 0.23.0), which ``Exl3MoEMethod.apply`` cannot
    count: the engine stops at start-up on a device-side assert, in every mode. The overlay's P9 maps the id to one
    the kernel takes; ``APHRODITE_MOE_SKIP_PADDING=0`` avoids it (docs/upstream/exl3-moe-padding-expert-ids.md)."""
    import importlib.util
    import os

    if not is_exl3_moe(shape):
        return
    if os.environ.get("APHRODITE_MOE_SKIP_PADDING", "").strip() == "0":
        report.add(
            "OK", "moe-padding", f"APHRODITE_MOE_SKIP_PADDING=0: padding rows keep real expert ids ({MOE_PADDING_DOC})"
        )
        return
    here = importlib.util.find_spec("aphrodite") is not None
    if p9_status in ("APPLIED", "UPSTREAM_FIXED") or (p9_status == "NOT_APPLICABLE" and here):
        how = {
            "APPLIED": "the overlay's P9 gives them an id the EXL3 expert kernel takes",
            "UPSTREAM_FIXED": "this aphrodite's EXL3 experts take them",
            "NOT_APPLICABLE": "this aphrodite's routers do not mark them (0.23.0+ do)",
        }[p9_status]
        report.add("OK", "moe-padding", f"EXL3 MoE and the padding rows' expert id -1: {how} ({MOE_PADDING_DOC})")
        return
    problem = (
        "aphrodite 0.23.0-0.24.1 give the rows a batch is padded with (CUDA-graph sizes, the profiling run) expert "
        "id -1, which the EXL3 expert kernel cannot count: every EXL3 MoE model stops at start-up on a device-side "
        "assert (scatter gather kernel index out of bounds), eager or compiled, with or without LoRA"
    )
    unknown = p9_status in (None, "NOT_APPLICABLE")  # no aphrodite here: the engine's release is not known
    report.add(
        "WARN" if unknown else "BLOCK",
        "moe-padding",
        f"EXL3 MoE, {without_fix('P9', p9_status)}: {problem}. Let P9 run, or set APHRODITE_MOE_SKIP_PADDING=0 for "
        f"the engine ({MOE_PADDING_DOC})",
    )


def installed_version() -> str | None:
    """The aphrodite-engine release importable here, or None."""
    import importlib.util

    if importlib.util.find_spec("aphrodite") is None:
        return None
    from hybrid_exl3_fixes import aphrodite_version

    return aphrodite_version()


def check_moe_release(report: Report, shape: Shape, version: str | None) -> None:
    """Whether a GPU run has served an EXL3 MoE model on the installed release with the overlay, and in which mode
    (overlay/compat.py, the README's compatibility table). Silent where aphrodite is not installed here."""
    from hybrid_exl3_fixes.compat import SERVED, moe_serving

    if not is_exl3_moe(shape) or version is None:
        return
    entry = moe_serving(version)
    served = ", ".join(SERVED)
    if entry is None or entry.kind == "not run":
        report.add(
            "WARN",
            "moe-release",
            f"EXL3 MoE on aphrodite {version}: no GPU run has served one on this release yet (the overlay's fixes are "
            f"tested on its code on the CPU); {served} serve in the default compiled mode with the overlay",
        )
    elif entry.kind == "compiled":
        report.add(
            "OK",
            "moe-release",
            f"EXL3 MoE on aphrodite {version}: serves in the default compiled mode ({entry.evidence})",
        )
    else:
        report.add(
            "WARN" if entry.kind == "eager" else "BLOCK",
            "moe-release",
            f"EXL3 MoE on aphrodite {version}: "
            + ("serves only with --enforce-eager" if entry.kind == "eager" else "does not start")
            + f" ({entry.evidence}); {served} serve in the default compiled mode with the overlay",
        )


def check_compiled_mode(
    report: Report, config: dict | Shape, enable_lora: bool, dtype: str = "auto", p4_status: str | None = None
) -> None:
    """The default compiled mode crashes on EXL3 Qwen3.5 GDN models only with float16 activations
    (an Inductor rewrite meets the bare cat EXL3's apply leaves when no cast follows; the overlay's P4
    removes it): OK for bfloat16, and for float16 where P4 runs or upstream fixed it; WARN otherwise.
    ``p4_status``: P4's status in this environment (None: the overlay could not be evaluated)."""
    shape = config if isinstance(config, Shape) else parse_config(config)[0]
    if (
        shape.quant.get("quant_method") != "exl3"
        or not shape.linear_layers
        or not (shape.arch or "").startswith("Qwen3_5")
    ):
        return
    act, source = activation_dtype(shape, dtype)
    if act != "float16":
        report.add(
            "OK",
            "compiled-mode",
            f"{act} activations ({source}): the default compiled mode works "
            f"(measured on aphrodite 0.21.0 with and without LoRA, {COMPILED_CRASH_DOC})",
        )
    elif p4_status in ("APPLIED", "UPSTREAM_FIXED"):
        who = "the overlay's P4 is applied here" if p4_status == "APPLIED" else "the installed aphrodite fixed it"
        report.add(
            "OK",
            "compiled-mode",
            f"float16 activations ({source}): the default compiled mode crashes on EXL3 "
            f"GDN models unless the fused projection's outputs are joined behind an op boundary; {who} "
            f"({COMPILED_CRASH_DOC})",
        )
    else:
        lora = (
            " --enable-lora avoids it on 0.20/0.21 (separate GDN projections), not on 0.24."
            if enable_lora
            else " On 0.20/0.21 --enable-lora avoids it too (separate GDN projections)."
        )
        report.add(
            "WARN",
            "compiled-mode",
            f"float16 activations ({source}) and the overlay's P4 is not active "
            f"({p4_status or 'overlay not evaluated'}): aphrodite's default compiled mode crashes on EXL3 GDN "
            'models with "CUDA error: an illegal memory access" in the first profiling run (Inductor folds '
            "the GDN split into the EXL3 concat and changes the strides one graph piece hands the next). "
            f"Serve with --dtype bfloat16 (measured), or let the overlay's P4 run, or use --enforce-eager.{lora} "
            f"{COMPILED_CRASH_DOC}",
        )
