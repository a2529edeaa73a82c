"""The folder's files: weights and their headers, tokenizer and processor files, image tokens."""

from __future__ import annotations

from pathlib import Path

from .base import DEFAULT_LONGEST_EDGE, KNOWN_ARCHS, PROCESSOR_FILES, TOKENIZER_SETS, Report
from .memory.vision import image_tokens as image_tokens_of
from .modelfiles import (
    Fields,
    Problem,
    describe,
    is_int,
    read_json_object,
    read_safetensors_header,
)
from .shape import VISION_DEFAULTS, Shape


def weight_files(report: Report, folder: Path) -> list[Path]:
    """The *.safetensors files, and the shards a model.safetensors.index.json names (missing ones reported)."""
    files = sorted(p for p in folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if not (index.exists() or index.is_symlink()):
        return files
    try:
        weight_map = Fields(read_json_object(index), index.name).object("weight_map", required=True)
    except Problem as exc:
        report.add("BLOCK", "weights", str(exc))
        return files
    if weight_map is None or not all(isinstance(v, str) for v in weight_map.values()):
        report.add(
            "BLOCK", "weights", f"{index.name}: weight_map is missing or does not map tensor names to file names"
        )
        return files
    missing = sorted({v for v in weight_map.values() if not (folder / v).exists()})
    if missing:
        report.add(
            "BLOCK",
            "weights",
            f"{index.name} names {len(missing)} shard(s) that are not in the folder: "
            f"{', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}; download them again",
        )
    return files


def read_weights(report: Report, folder: Path) -> dict[str, dict]:
    """name -> {"dtype", "shape", "bytes", "file"} from every readable safetensors header; one BLOCK per
    file that is not (truncated, corrupt, unreadable)."""
    tensors = {}
    for path in weight_files(report, folder):
        try:
            found = read_safetensors_header(path)
        except Problem as exc:
            report.add("BLOCK", "weights", f"{exc}; download the file again")
            continue
        tensors.update({k: t.__dict__ for k, t in found.items()})
    return tensors


def image_tokens(report: Report, folder: Path, shape: Shape, language_model_only: bool = False) -> tuple[int, str]:
    vision = shape.vision or VISION_DEFAULTS
    patch, merge = vision["patch"], vision["merge"]
    longest = DEFAULT_LONGEST_EDGE
    level = "WARN" if language_model_only else "BLOCK"  # text only: the engine does not need the processor
    pre = folder / "preprocessor_config.json"
    if pre.exists() or pre.is_symlink():
        try:
            size = Fields(read_json_object(pre), pre.name).object("size") or {}
            fields = Fields(size, f"{pre.name} size")
            longest = fields.positive_int("longest_edge", required=False) or longest
            for problem in fields.problems:
                report.add(level, "processor", problem + "; copy it from the base model")
        except Problem as exc:
            report.add(level, "processor", f"{exc}; copy it from the base model")
    tokens = image_tokens_of(vision, longest)
    return tokens, f"longest_edge {longest:,} px / ({patch} x {merge})^2 = {tokens:,} tokens per image"


def read_tensor_storage(report: Report, folder: Path) -> dict[str, dict] | None:
    """quantization_config.json's tensor_storage, keeping the well-formed entries (each malformed one is
    reported); None when the file itself cannot be used."""
    qfile = folder / "quantization_config.json"
    try:
        fields = Fields(read_json_object(qfile), qfile.name)
    except Problem as exc:
        report.add("BLOCK", "exl3", f"config.json says EXL3, but {exc}: it is the converter's output, copy it again")
        return None
    storage = fields.object("tensor_storage", required=True)
    if storage is None:
        report.add("BLOCK", "exl3", f"{fields.problems[0]}: copy the converter's output again")
        return None
    good, bad = {}, []
    for prefix, entry in storage.items():
        if not isinstance(entry, dict):
            bad.append(f"{prefix} is {describe(entry)}")
            continue
        stored = entry.get("stored_tensors", {})
        if not isinstance(stored, dict) or not all(
            isinstance(i, dict)
            and (i.get("shape") is None or (isinstance(i.get("shape"), list) and all(is_int(d) for d in i["shape"])))
            for i in stored.values()
        ):
            bad.append(f"{prefix}.stored_tensors is not an object of {{shape: [sizes]}} entries")
            continue
        if "quant_format" in entry and not isinstance(entry["quant_format"], str):
            bad.append(f"{prefix}.quant_format is {describe(entry['quant_format'])}")
            continue
        good[prefix] = entry
    if bad:
        report.add("BLOCK", "exl3", f"{qfile.name}: {len(bad)} malformed tensor_storage entries, first: {bad[0]}")
    return good


def check_files(report: Report, folder: Path, shape: Shape, language_model_only: bool) -> None:
    arch = shape.arch or "?"
    if arch in KNOWN_ARCHS:
        report.add("OK", "architecture", f"{arch}: {KNOWN_ARCHS[arch]}")
    elif shape.arch is not None:
        report.add("WARN", "architecture", f"{arch} is not a hybrid GDN architecture this tool knows")
    if not any(all((folder / f).is_file() for f in group) for group in TOKENIZER_SETS):
        report.add(
            "BLOCK",
            "tokenizer",
            "no tokenizer: copy tokenizer.json (or vocab.json + merges.txt) and "
            "tokenizer_config.json from the base model",
        )
    if arch.endswith("ForConditionalGeneration"):
        missing = [f for f in PROCESSOR_FILES if not (folder / f).is_file()]
        if not (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            missing.append("vocab.json")
        if missing and not language_model_only:
            report.add(
                "BLOCK",
                "processor",
                f"missing {', '.join(missing)}: the engine fails with \"Can't load image "
                f'processor". Copy them from the base model ({shape.name_or_path or "the original repo"}), '
                "or serve text only with --language-model-only",
            )
        elif missing:
            report.add("OK", "processor", f"missing {', '.join(missing)}, not needed with --language-model-only")
        else:
            report.add("OK", "processor", "processor files present")
