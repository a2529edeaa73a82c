"""``hybrid-exl3-fixes doctor MODEL_DIR``: preflight for hybrid GDN (+EXL3) deployments.

Reads only the model folder's JSON files and the safetensors headers (no weights are loaded).
Findings are OK / WARN / BLOCK; exit 0 (all ok), 1 (warnings), 2 (a blocking problem).

The memory plan counts what a hybrid model really holds:
- per-token KV only in the full-attention layers:
  ``full_layers x kv_heads x head_dim x 2 (K and V) x bytes(kv dtype)``;
- per-sequence recurrent state in each linear-attention (GatedDeltaNet) layer, independent of context:
  ``value_heads x key_head_dim x value_head_dim x bytes`` (the activations' dtype unless the config's
  ``mamba_ssm_dtype`` says otherwise, as the engine's block size follows) plus the conv state
  ``(2 x key_dim + value_dim) x (conv_kernel - 1) x 2 bytes``;
- weights exactly as stored (EXL3 trellis, scales and markers counted from the safetensors headers);
- given ``--gpu-mem``, the engine's own arithmetic to its KV pool, tokens and concurrency (arithmetic.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from ..decisions import p12_mid_batch as midbatch
from .base import (
    COLUMN,
    COMPILED_CRASH_DOC,
    CONFIG_DTYPES,
    DEFAULT_LONGEST_EDGE,
    DTYPE_CHOICES,
    GIB,
    KNOWN_ARCHS,
    MIB,
    PROCESSOR_FILES,
    ROW,
    TOKENIZER_SETS,
    Finding,
    Options,
    Report,
)
from .engine_checks import (
    MOE_GRAPH_DOC,
    MOE_LORA_DOC,
    MOE_PADDING_DOC,
    MOE_STREAM_DOC,
    activation_dtype,
    check_compiled_mode,
    check_dtype,
    check_moe_graphs,
    check_moe_lora,
    check_moe_padding,
    check_moe_release,
    check_moe_stream,
    check_release,
    installed_version,
    is_exl3_moe,
    without_fix,
)
from .exl3_checks import check_exl3, check_exl3_experts, codebook_of
from .files import check_files, image_tokens, read_tensor_storage, read_weights, weight_files
from .memory.arithmetic import Engine
from .memory.plan import kv_bytes_per_token, memory_plan, state_bytes_per_sequence
from .shape import FIX_CONFIG, Shape, parse_config, read_config, text_config

__all__ = [
    "COLUMN",
    "COMPILED_CRASH_DOC",
    "CONFIG_DTYPES",
    "DEFAULT_LONGEST_EDGE",
    "DTYPE_CHOICES",
    "FIX_CONFIG",
    "Finding",
    "GIB",
    "KNOWN_ARCHS",
    "MIB",
    "MOE_GRAPH_DOC",
    "MOE_LORA_DOC",
    "MOE_PADDING_DOC",
    "MOE_STREAM_DOC",
    "PROCESSOR_FILES",
    "ROW",
    "Options",
    "Report",
    "Shape",
    "TOKENIZER_SETS",
    "activation_dtype",
    "as_json",
    "check_compiled_mode",
    "check_dtype",
    "check_exl3",
    "check_exl3_experts",
    "check_files",
    "check_moe_graphs",
    "check_moe_lora",
    "check_moe_padding",
    "check_moe_release",
    "check_moe_stream",
    "check_release",
    "codebook_of",
    "diagnose",
    "image_tokens",
    "installed_version",
    "is_exl3_moe",
    "kv_bytes_per_token",
    "memory_plan",
    "overlay_status",
    "parse_config",
    "read_config",
    "read_tensor_storage",
    "read_weights",
    "render",
    "state_bytes_per_sequence",
    "text_config",
    "weight_files",
    "without_fix",
]


def overlay_status(report: Report) -> dict[str, str]:
    """Adds the overlay's summary; returns {patch id: status} (empty when it cannot be evaluated). Read from a
    fresh process (``status_report``): doctor neither patches nor imports aphrodite in its own."""
    try:
        import hybrid_exl3_fixes as overlay

        data = overlay.status_report()
    except Exception as exc:  # noqa: BLE001 - reported, never fatal
        report.add("WARN", "overlay", f"could not evaluate the patches: {exc}")
        return {}
    from hybrid_exl3_fixes.registry import PROBLEM_STATUSES

    problems = {s.value for s in PROBLEM_STATUSES}
    gate = data.get("plugin_gate")
    if gate:  # the table is what it would do; the engine will run without it
        report.add("WARN", "overlay", f"aphrodite will not load the overlay: {gate}")
        return {p["id"]: f"not loaded ({gate})" for p in data["patches"]}
    drifted = any(p["status"] in problems for p in data["patches"])
    report.add("WARN" if drifted else "OK", "overlay", data["summary"])
    return {p["id"]: p["status"] for p in data["patches"]}


def diagnose(model_dir: str | Path, options: Options | None = None, **flags) -> Report:
    """Every check on the folder, each problem one finding (a broken input never stops the others). The engine
    is described by ``options``, or by its fields given as keywords (``diagnose(d, gpu_mem=24, tp=2)``)."""
    if options is None:
        options = Options(**flags)
    elif flags:
        options = dataclasses.replace(options, **flags)
    o = options
    folder = Path(model_dir)
    report = Report(str(folder))
    if not folder.is_dir():
        what = (
            "is a file, not a folder: give the folder that holds config.json" if folder.exists() else "does not exist"
        )
        report.add("BLOCK", "config", f"{folder} {what}")
        return report
    try:
        next(folder.iterdir(), None)
    except OSError as exc:
        report.add("BLOCK", "config", f"{folder} cannot be listed: {exc.strerror or exc}")
        return report
    config, shape = read_config(report, folder)
    shape = shape or Shape()
    if o.mamba_ssm_cache_dtype != "auto":  # the flag wins over the config (aphrodite models/config.py, Qwen3.5)
        shape.ssm_dtype, shape.ssm_source = o.mamba_ssm_cache_dtype, "--mamba-ssm-cache-dtype"
    check_files(report, folder, shape, o.language_model_only)
    tensors = read_weights(report, folder)
    if not tensors and not any(f.check == "weights" for f in report.findings):
        report.add("WARN", "weights", "no *.safetensors in the folder: the weight plan below is empty")
    if config is not None:
        check_exl3(report, folder, shape, tensors, o.tp)
    counts = {t: shape.layer_types.count(t) for t in sorted(set(shape.layer_types))}
    report.add("OK", "layers", ", ".join(f"{n} {t}" for t, n in counts.items()) or "no layer_types (not hybrid)")
    release = o.release or (installed_version() if o.check_overlay else None)
    check_release(report, release, named=o.release is not None)
    served = config is None or check_dtype(report, shape, o.dtype, release)
    if o.check_overlay:
        statuses = overlay_status(report)
        if config is not None:
            if served:
                check_compiled_mode(report, shape, o.enable_lora, o.dtype, statuses.get("P4"))
            check_moe_lora(report, shape, o.enable_lora, statuses.get("P5"))
            check_moe_graphs(report, shape, o.enforce_eager, statuses.get("P7"))
            check_moe_stream(report, shape, statuses.get("P6"))
            check_moe_padding(report, shape, statuses.get("P9"))
            check_moe_release(report, shape, release)
    if not served:
        return report
    engine = Engine(
        o.gpu_mem or 0,
        tp=o.tp,
        utilization=o.utilization,
        max_model_len=o.max_model_len or shape.max_position or 4096,
        max_num_seqs=o.max_num_seqs,
        max_num_batched_tokens=o.max_num_batched_tokens,
        kv_dtype=o.kv_dtype,
        dtype=activation_dtype(shape, o.dtype)[0],
        eager=o.enforce_eager,
        lora=o.enable_lora,
        max_loras=o.max_loras,
        max_lora_rank=o.max_lora_rank,
        language_model_only=o.language_model_only,
        image_limit=o.image_limit,
        prefix_caching=o.prefix_caching,
        release=release,
        exl3_keep=exl3_keep(report),
    )
    report.plan = memory_plan(report, folder, shape, tensors, o.gpu_mem, o.gpus, engine)
    return report


def exl3_keep(report: Report) -> int | None:
    """P12's opt-in as the engine will read it (HYBRID_EXL3_FIXES_EXL3_KEEP in this environment); a bad value is a
    WARN (P12 then stays off in the engine) and plans nothing."""
    try:
        budget = midbatch.keep_budget(os.environ)
    except midbatch.KeepSettingError as exc:
        report.add("WARN", "exl3-keep", f"{exc}; the engine's P12 stays off with it")
        return None
    if budget is not None:
        report.add("OK", "exl3-keep", f"P12 keeps float16 EXL3 weights: {midbatch.describe_budget(budget)} (planned)")
    return budget


def render(report: Report) -> str:
    lines = [f"hybrid-exl3-fixes doctor: {report.model}"]
    lines += [f"  {f.level:<5} {f.check:<13} {f.message}" for f in report.findings]
    p = report.plan
    if p:
        lines.append("memory plan:")
        lines.append(f"  KV per token        {p['kv_bytes_per_token'] / 1024:,.1f} KiB   = {p['kv_formula']}")
        lines.append(f"  state per sequence  {p['state_bytes_per_sequence'] / MIB:,.2f} MiB   = {p['state_formula']}")
        lines.append(
            f"  weights             {p['weight_bytes'] / GIB:,.3f} GiB (EXL3 {p['exl3_weight_bytes'] / GIB:,.3f} GiB, "
            f"vision {p['vision_weight_bytes'] / GIB:,.3f} GiB"
            + (f", MTP head {p['mtp_weight_bytes'] / GIB:,.3f} GiB, not loaded" if p.get("mtp_weight_bytes") else "")
            + ")"
        )
        lines.append(f"  image tokens        {p['image_formula']}")
        if "expert_formula" in p:
            lines.append(
                f"  experts             {p['active_expert_bytes_per_token'] / MIB:,.1f} MiB read per token = "
                f"{p['expert_formula']}"
            )
        if "kv_pool_bytes" in p:
            lines.append(f"  engine              {p['engine']['defaults']}")
            u = p["uncertainty"]
            for name, t in p["terms"].items():
                sign = "" if name == "requested" else "- "
                b = u["terms"].get(name, {})
                bounded = f"; -{b['low'] / GIB:.3f}/+{b['high'] / GIB:.3f} GiB: {b['why']}" if b.get("high") else ""
                lines.append(f"  {sign + name:<19} {t['gib']:>7.3f} GiB = {t['formula']} [{t['basis']}{bounded}]")
            lines.append(f"  = KV pool           {p['kv_pool_bytes'] / GIB:7.3f} GiB per GPU")
            lines.append(
                f"  pool range          {u['pool_gib'][0]:.3f} - {u['pool_gib'][1]:.3f} GiB (the bounds above: pool "
                f"-{u['pool_minus_bytes'] / GIB:.3f} / +{u['pool_plus_bytes'] / GIB:.3f} GiB)"
            )
            lines.append(f"  KV layout           {p['layout']['formula']}")
            lines.append(
                f"  capacity            {p['kv_cache_tokens']:,} tokens, concurrency {p['max_concurrency']:.2f}x at "
                f"{p['context']:,} tokens = {p['concurrency_formula']}"
            )
            lines.append(
                f"  capacity range      {u['kv_cache_tokens'][0]:,} - {u['kv_cache_tokens'][1]:,} tokens, concurrency "
                f"{u['max_concurrency'][0]:.2f} - {u['max_concurrency'][1]:.2f}x (the pool range above)"
            )
            lines.append(
                f"  pin after a start   --kv-cache-memory-bytes {p['pin_kv_cache_memory']} (this plan's pool less the "
                "engine's 150 MiB margin; prefer the figure the engine logs)"
            )
            if not p["engine"]["enforce_eager"]:
                lines.append(
                    f"  pin at least        --kv-cache-memory-bytes {p['min_kv_cache_memory_for_graphs']} "
                    f"with CUDA graphs (one Mamba cache block per sequence: {p['engine']['max_num_seqs']:,} x "
                    f"{p['layout']['page_bytes']:,} B x {p['layout']['group_size']})"
                )
    lines.append({0: "result: ok", 1: "result: warnings", 2: "result: blocking problems"}[report.exit_code])
    return "\n".join(lines)


def as_json(report: Report) -> str:
    return json.dumps(
        {
            "model": report.model,
            "exit_code": report.exit_code,
            "findings": [f.__dict__ for f in report.findings],
            "plan": report.plan,
        },
        indent=2,
    )
