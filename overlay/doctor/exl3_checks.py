"""EXL3 checks: the quantization config against the tensors, tensor-parallel splits, the experts' codebooks."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import HAD, splits_into_blocks
from .base import COLUMN, ROW, Report
from .files import read_tensor_storage
from .modelfiles import (
    TORCH_DTYPE_NAMES,
)
from .shape import Shape


def check_exl3(report: Report, folder: Path, shape: Shape, tensors: dict[str, dict], tp: int) -> None:
    method = shape.quant.get("quant_method")
    if method != "exl3":
        trellises = sorted(k for k in tensors if k.endswith(".trellis"))
        if trellises:
            said = (
                f"quantization_config.quant_method is {method!r}" if shape.quant else "quantization_config is missing"
            )
            report.add(
                "BLOCK",
                "quantization",
                f"the safetensors hold {len(trellises)} EXL3 tensors ({trellises[0]}, "
                f"...) but config.json's {said}: copy config.json from the EXL3 conversion",
            )
        else:
            report.add("OK", "quantization", f"not EXL3 ({method or 'unquantized'})")
        return
    storage = read_tensor_storage(report, folder)
    if storage is None:
        return
    exl3 = {k: v for k, v in storage.items() if v.get("quant_format") == "exl3"}
    missing, differ = [], []
    for prefix, entry in storage.items():  # exllamav3 lists every leaf module, quantized or not
        for name, info in entry.get("stored_tensors", {}).items():
            if name not in tensors:
                missing.append(name)
            elif info.get("shape") is not None and list(info["shape"]) != list(tensors[name]["shape"]):
                differ.append(f"{name} {info['shape']} != {tensors[name]['shape']}")
            elif isinstance(info.get("dtype"), str) and info["dtype"] != TORCH_DTYPE_NAMES.get(tensors[name]["dtype"]):
                differ.append(f"{name} {info['dtype']} != {tensors[name]['dtype']}")
        if prefix in exl3 and f"{prefix}.trellis" not in tensors and f"{prefix}.trellis" not in missing:
            missing.append(f"{prefix}.trellis")
    if missing or differ:
        report.add(
            "BLOCK",
            "exl3",
            f"tensor_storage disagrees with the safetensors: {len(missing)} missing "
            f"({', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}), {len(differ)} shape or dtype differences "
            f"({'; '.join(differ[:2])})",
        )
    else:
        report.add("OK", "exl3", f"{len(exl3)} EXL3 modules, every stored tensor present with its shape")
    head_exl3 = any(k.startswith("lm_head.") and k.endswith(".trellis") for k in tensors)
    head_bits = shape.quant.get("head_bits")
    if head_bits is not None and not head_exl3:
        report.add(
            "BLOCK",
            "head_bits",
            f"head_bits = {head_bits} but lm_head is not stored as EXL3: aphrodite "
            "treats lm_head as EXL3 whenever head_bits is set and will miss its trellis. Set head_bits to null",
        )
    elif head_bits is None and head_exl3:
        report.add(
            "BLOCK",
            "head_bits",
            "lm_head is stored as EXL3 but head_bits is null: aphrodite will load it as a "
            "dense layer. Set head_bits to the head's bitrate",
        )
    else:
        report.add("OK", "head_bits", f"head_bits = {head_bits} matches how lm_head is stored")
    gdn = shape.gdn or {}
    key_dim = gdn.get("key_heads", 0) * gdn.get("key_dim", 0)
    value_dim = gdn.get("value_heads", 0) * gdn.get("value_dim", 0)
    bad = []
    for prefix in exl3:
        trellis = tensors.get(f"{prefix}.trellis")
        if trellis is None:
            continue
        if len(trellis["shape"]) != 3:
            bad.append(f"{prefix}.trellis has shape {trellis['shape']}, not (in/16, out/16, 16 x bits)")
            continue
        fin, fout = trellis["shape"][0] * 16, trellis["shape"][1] * 16
        name = prefix.rsplit(".", 1)[-1]
        # fused GDN projections are split per section (q, k, v[, z]), each across the ranks
        sections = {
            "in_proj_qkv": [key_dim, key_dim, value_dim],
            "in_proj_qkvz": [key_dim, key_dim, value_dim, value_dim],
        }.get(name)
        splits = (
            sections
            if sections and sum(sections) == fout
            else [fout]
            if name in COLUMN
            else [fin]
            if name in ROW
            else []
        )
        if fin % HAD or fout % HAD:
            bad.append(f"{prefix} {fin}x{fout} not 128-aligned")
            continue
        for split in splits:
            if not splits_into_blocks(split, tp):
                bad.append(f"{prefix}: {split} / TP {tp} = {split / tp:g} is not a multiple of {HAD}")
                break
    check_exl3_experts(report, exl3, tensors)
    if bad:
        report.add(
            "BLOCK",
            "tp-alignment",
            f"{len(bad)} EXL3 dimension(s) cut a 128-wide Hadamard block at TP={tp}: " + "; ".join(bad[:3]),
        )
    else:
        report.add("OK", "tp-alignment", f"every EXL3 dimension splits into 128-multiples at TP={tp}")


def codebook_of(prefix: str, entry: dict, tensors: dict) -> str:
    if "mcg_multiplier" in entry or f"{prefix}.mcg" in tensors:
        return "mcg"
    if "mul1_multiplier" in entry or f"{prefix}.mul1" in tensors:
        return "mul1"
    return "3inst"


def check_exl3_experts(report: Report, exl3: dict[str, dict], tensors: dict) -> None:
    """aphrodite's EXL3 MoE kernel takes only some codebooks (mcg on 0.20-0.23, mcg and mul1 on 0.24),
    read from the installed kernel library's own error message; an expert in another one is a BLOCK."""
    experts = {p: codebook_of(p, e, tensors) for p, e in exl3.items() if ".experts." in p}
    if not experts:
        return
    from ..decisions import exl3_kernels as kernels

    allowed, evidence = kernels.moe_codebooks(kernels.installed_kernel_libraries())
    rule = allowed or frozenset({"mcg"})
    found = sorted(set(experts.values()))
    wrong = sorted(p for p, cb in experts.items() if cb not in rule)
    if not wrong:
        report.add(
            "OK",
            "moe-codebook",
            f"{len(experts)} EXL3 expert projections, codebook {', '.join(found)}: "
            f"the EXL3 MoE kernel takes {'/'.join(sorted(rule))} ({evidence})",
        )
        return
    where = (
        evidence
        if allowed
        else (
            "no kernel library installed here to ask; mcg is the codebook every release "
            "takes (0.20-0.23: mcg only, 0.24: mcg and mul1)"
        )
    )
    report.add(
        "BLOCK" if allowed else "WARN",
        "moe-codebook",
        f"{len(wrong)} of {len(experts)} EXL3 expert projections use codebook "
        f"{', '.join(sorted({experts[p] for p in wrong}))} ({wrong[0]}, ...): aphrodite's EXL3 MoE kernel takes "
        f"only {'/'.join(sorted(rule))} ({where}); quantize the experts with exllamav3's --codebook mcg",
    )
