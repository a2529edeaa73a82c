"""``hybrid-exl3-fixes doctor MODEL_DIR``: preflight for hybrid GDN (+EXL3) deployments.

Reads only the model folder's JSON files and the safetensors headers (no weights are loaded).
Findings are OK / WARN / BLOCK; exit 0 (all ok), 1 (warnings), 2 (a blocking problem).

The memory plan counts what a hybrid model really holds:
- per-token KV only in the full-attention layers:
  ``full_layers x kv_heads x head_dim x 2 (K and V) x bytes(kv dtype)``;
- per-sequence recurrent state in each linear-attention (GatedDeltaNet) layer, independent of context:
  ``value_heads x key_head_dim x value_head_dim x bytes`` (the activations' dtype unless the config's
  ``mamba_ssm_dtype`` says otherwise: aphrodite 0.21, run 11's block size) plus the conv state
  ``(2 x key_dim + value_dim) x (conv_kernel - 1) x 2 bytes``;
- weights exactly as stored (EXL3 trellis, scales and markers counted from the safetensors headers);
- given ``--gpu-mem``, the engine's own arithmetic to its KV pool, tokens and concurrency (memplan.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from . import memplan
from .exl3 import HAD, splits_into_blocks
from .memplan import Engine
from .modelfiles import (
    TORCH_DTYPE_NAMES,
    Fields,
    Problem,
    describe,
    is_int,
    read_json_object,
    read_safetensors_header,
)

GIB = 1 << 30
MIB = 1 << 20
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")
TOKENIZER_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"))
KNOWN_ARCHS = {
    "Qwen3_5ForConditionalGeneration": "aphrodite >= 0.20",
    "Qwen3_5MoeForConditionalGeneration": "aphrodite >= 0.20",
    "Qwen3_5ForCausalLM": "aphrodite >= 0.23 (text-only checkpoints do not load in 0.21)",
    "Qwen3NextForCausalLM": "aphrodite >= 0.20",
}
# Column-parallel projections split their output across TP ranks, row-parallel ones their input.
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_qkv", "in_proj_z", "in_proj_qkvz")
ROW = ("o_proj", "down_proj", "out_proj")
DEFAULT_LONGEST_EDGE = 16_777_216
# --dtype values aphrodite accepts, by the activation dtype they give (auto: the config's)
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "half", "float32", "float")
CONFIG_DTYPES = ("bfloat16", "float16", "float32", "half", "float", "auto")
COMPILED_CRASH_DOC = "docs/upstream/exl3-compiled-illegal-address.md"


@dataclass
class Finding:
    level: str  # OK | WARN | BLOCK
    check: str
    message: str


@dataclass
class Report:
    model: str
    findings: list[Finding] = field(default_factory=list)
    plan: dict = field(default_factory=dict)

    def add(self, level: str, check: str, message: str) -> None:
        self.findings.append(Finding(level, check, message))

    @property
    def exit_code(self) -> int:
        levels = {f.level for f in self.findings}
        return 2 if "BLOCK" in levels else 1 if "WARN" in levels else 0


def text_config(config: dict) -> dict:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


@dataclass
class Shape:
    """The config.json fields doctor reads, type-checked (a field that is missing or of the wrong type is
    None here and one BLOCK in the report)."""

    arch: str | None = None
    layer_types: list[str] = field(default_factory=list)
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    gdn: dict | None = None  # value_heads, key_heads, key_dim, value_dim, kernel
    max_position: int | None = None
    quant: dict = field(default_factory=dict)  # quant_method, head_bits (validated)
    vision: dict | None = None  # patch, merge
    declared_dtype: str | None = None
    name_or_path: str | None = None
    moe: dict | None = None  # experts, per_token, intermediate, shared_intermediate (MoE configs)
    vocab: int | None = None  # these three size the memory plan's activation and LoRA terms only:
    intermediate: int | None = None  # read without complaint (a missing one leaves its term smaller)
    ssm_dtype: str | None = None  # text_config.mamba_ssm_dtype: the GDN state's dtype when given

    @property
    def full_layers(self) -> int:
        return sum(t == "full_attention" for t in self.layer_types)

    @property
    def linear_layers(self) -> int:
        return sum(t == "linear_attention" for t in self.layer_types)

    @property
    def kv_ready(self) -> bool:
        return bool(self.layer_types) and (not self.full_layers or (self.kv_heads and self.head_dim) is not None)

    @property
    def state_ready(self) -> bool:
        return bool(self.layer_types) and (not self.linear_layers or self.gdn is not None)


FIX_CONFIG = " (compare with the base model's config.json)"


def parse_config(config: dict) -> tuple[Shape, list[str]]:
    """The validated shape and every problem found, each naming the field."""
    top = Fields(config, "config.json")
    shape = Shape()
    archs = top.strings("architectures", hint=": the engine picks the model class from it" + FIX_CONFIG)
    shape.arch = archs[0] if archs else None
    shape.name_or_path = config.get("_name_or_path") if isinstance(config.get("_name_or_path"), str) else None
    where = "config.json"
    if "text_config" in config:
        if not isinstance(config["text_config"], dict):
            top.problems.append(
                f"config.json: text_config is {describe(config['text_config'])}, expected an object" + FIX_CONFIG
            )
            return shape, top.problems
        where = "config.json text_config"
    text = Fields(text_config(config), where)
    shape.hidden = text.positive_int("hidden_size", hint=FIX_CONFIG)
    shape.heads = text.positive_int("num_attention_heads", hint=FIX_CONFIG)
    layers = text.positive_int("num_hidden_layers", hint=FIX_CONFIG)
    types = text.strings("layer_types", required=False, hint=FIX_CONFIG)
    if types is not None:
        unknown = sorted(set(types) - {"linear_attention", "full_attention"})
        if unknown:
            text.problems.append(
                f"{where}: layer_types holds {', '.join(map(repr, unknown))}, expected "
                "'linear_attention' or 'full_attention'"
            )
        elif layers is not None and len(types) != layers:
            text.problems.append(f"{where}: layer_types lists {len(types)} layers but num_hidden_layers is {layers}")
        else:
            shape.layer_types = types
    elif layers is not None and "layer_types" not in text.data:
        shape.layer_types = ["full_attention"] * layers
    if shape.full_layers:
        shape.kv_heads = text.positive_int("num_key_value_heads", hint=": the KV cache is sized from it" + FIX_CONFIG)
        head_dim = text.positive_int("head_dim", required=False, hint=FIX_CONFIG)
        shape.head_dim = head_dim or (shape.hidden // shape.heads if shape.hidden and shape.heads else None)
    if shape.linear_layers:
        hint = ": the GatedDeltaNet state is sized from it" + FIX_CONFIG
        gdn = {
            key: text.positive_int(name, hint=hint)
            for key, name in (
                ("value_heads", "linear_num_value_heads"),
                ("key_heads", "linear_num_key_heads"),
                ("key_dim", "linear_key_head_dim"),
                ("value_dim", "linear_value_head_dim"),
            )
        }
        gdn["kernel"] = text.positive_int("linear_conv_kernel_dim", required=False, hint=FIX_CONFIG) or 4
        shape.gdn = gdn if all(v is not None for v in gdn.values()) else None
    shape.max_position = text.positive_int("max_position_embeddings", required=False, hint=FIX_CONFIG)
    data = text.data
    shape.vocab = data.get("vocab_size") if is_int(data.get("vocab_size")) and data["vocab_size"] > 0 else None
    inter = data.get("intermediate_size")
    shape.intermediate = inter if is_int(inter) and inter > 0 else None
    ssm = data.get("mamba_ssm_dtype")
    shape.ssm_dtype = ssm if ssm in ("float32", "bfloat16", "float16") else None
    if "num_experts" in text.data or "Moe" in (shape.arch or ""):
        hint = ": the routed experts are sized from it" + FIX_CONFIG
        shape.moe = {
            "experts": text.positive_int("num_experts", hint=hint),
            "per_token": text.positive_int("num_experts_per_tok", hint=hint),
            "intermediate": text.positive_int("moe_intermediate_size", hint=hint),
            "shared_intermediate": text.positive_int("shared_expert_intermediate_size", required=False),
        }
    for fields in (top, text):
        for key in ("dtype", "torch_dtype"):
            declared = fields.string(key, required=False)
            if declared is not None and declared not in CONFIG_DTYPES:
                fields.problems.append(
                    f"{fields.where}: {key} is {describe(declared)}, not a dtype the engine knows "
                    f"({', '.join(CONFIG_DTYPES)})"
                )
            elif declared is not None:
                shape.declared_dtype = shape.declared_dtype or declared
    qcfg = top.object("quantization_config")
    if qcfg is not None:
        q = Fields(qcfg, "config.json quantization_config")
        shape.quant = {
            "quant_method": q.string("quant_method", hint=": which quantization the weights use"),
            "head_bits": q.number("head_bits", required=False),
        }
        top.problems += q.problems
    vision = top.object("vision_config")
    if vision is not None:
        v = Fields(vision, "config.json vision_config")
        shape.vision = {
            "patch": v.positive_int("patch_size", required=False) or 16,
            "merge": v.positive_int("spatial_merge_size", required=False) or 2,
        }
        top.problems += v.problems
    return shape, top.problems + text.problems


def read_config(report: Report, folder: Path) -> tuple[dict | None, Shape | None]:
    try:
        config = read_json_object(folder / "config.json")
    except Problem as exc:
        hint = " (is this the model folder, the one with the .safetensors?)" if "does not exist" in str(exc) else ""
        report.add("BLOCK", "config", f"{exc}{hint}")
        return None, None
    shape, problems = parse_config(config)
    for problem in problems:
        report.add("BLOCK", "config", problem)
    if not problems:
        report.add("OK", "config", "config.json parses and has every field doctor reads")
    return config, shape


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


def kv_bytes_per_token(shape: Shape, kv_dtype: str, dtype: str = "bfloat16") -> tuple[int, str]:
    """KV bytes per token over the full-attention layers; ``auto`` keeps the cache in the activations' ``dtype``."""
    full = shape.full_layers
    heads, dim = shape.kv_heads or 0, shape.head_dim or 0
    width = 1 if kv_dtype.startswith("fp8") else memplan.dtype_bytes(dtype if kv_dtype == "auto" else kv_dtype)
    return full * heads * dim * 2 * width, f"{full} full layers x {heads} KV heads x {dim} x 2 (K,V) x {width} B"


def state_bytes_per_sequence(shape: Shape, dtype: str = "bfloat16") -> tuple[int, int, str]:
    """The GDN state of one sequence, over every linear-attention layer (memplan.gdn_state_bytes per layer)."""
    linear = shape.linear_layers
    if not linear or shape.gdn is None:
        return 0, 0, "no linear-attention layers"
    g = shape.gdn
    recurrent, conv, ssm, width = memplan.gdn_state_bytes(shape, dtype)
    source = "mamba_ssm_dtype" if shape.ssm_dtype else dtype
    return (
        linear * recurrent,
        linear * conv,
        (
            f"{linear} linear layers x ({g['value_heads']} value heads x {g['key_dim']} x {g['value_dim']} x {ssm} B "
            f"recurrent ({source}) + {2 * g['key_heads'] * g['key_dim'] + g['value_heads'] * g['value_dim']} conv "
            f"channels x {g['kernel'] - 1} x {width} B)"
        ),
    )


def image_tokens(report: Report, folder: Path, shape: Shape, language_model_only: bool = False) -> tuple[int, str]:
    vision = shape.vision or {"patch": 16, "merge": 2}
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
    tokens = longest // (patch * merge) ** 2
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
    from .exl3 import dispatch

    allowed, evidence = dispatch.moe_codebooks(dispatch.installed_kernel_libraries())
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


def activation_dtype(shape: Shape, dtype: str = "auto") -> tuple[str, str]:
    """The dtype the engine computes in, and where it comes from: ``--dtype``, else the config's
    (aphrodite's ``auto``; a float32 or absent config dtype gives bfloat16 on a GPU that has it)."""
    if dtype != "auto":
        return memplan.canonical_dtype(dtype), f"--dtype {dtype}"
    declared = shape.declared_dtype
    if declared in ("bfloat16", "float16"):
        return declared, f"config.json dtype {declared}"
    return "bfloat16", f"config.json dtype {declared or 'not set'} (auto: bfloat16)"


MOE_LORA_DOC = "docs/upstream/exl3-moe-lora-device.md"


def is_exl3_moe(shape: Shape) -> bool:
    return bool(shape.moe) and shape.quant.get("quant_method") == "exl3"


def check_moe_lora(report: Report, shape: Shape, enable_lora: bool, p5_status: str | None) -> None:
    """EXL3 MoE + --enable-lora: every release 0.20.0-0.24.1 wraps the EXL3 MoE layers in FusedMoEWithLoRA,
    which needs a modular kernel Exl3MoEMethod lacks, and fails at start-up (H200, 0.21.0, run 11) unless
    the overlay's P5 leaves them unwrapped."""
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
    that gets more than 128 of a captured batch's tokens (run 13, H200, 0.21.0: 0.185 nats off HF with 16
    requests at once); the overlay's P7 chunks the captured batch. OK in eager mode or where P7 runs."""
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
    routed experts for batches of <= 256 tokens, both EXL3 kernels on one lock array; an eager server stopped
    answering without P6 (run 14, H200, 0.21.0; run 12 the same; intermittent). 0.20.0 kept them on one stream."""
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
    count: the engine stops at start-up on a device-side assert (run 15, H200, 0.24.1, eager and compiled, with and
    without LoRA). The overlay's P9 maps the id to one the kernel takes; ``APHRODITE_MOE_SKIP_PADDING=0`` avoids it."""
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

    entry = moe_serving(version)
    if not is_exl3_moe(shape) or version is None:
        return
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


def overlay_status(report: Report) -> dict[str, str]:
    """Adds the overlay's summary; returns {patch id: status} (empty when it cannot be evaluated)."""
    try:
        import hybrid_exl3_fixes as overlay

        results = overlay.status()
    except Exception as exc:  # noqa: BLE001 - reported, never fatal
        report.add("WARN", "overlay", f"could not evaluate the patches: {exc}")
        return {}
    drifted = [r for r in results if r.is_problem]
    gate = overlay.plugin_gate()
    if gate:  # the table is what it would do; the engine will run without it
        report.add("WARN", "overlay", f"aphrodite will not load the overlay: {gate}")
        return {r.patch.id: f"not loaded ({gate})" for r in results}
    report.add("WARN" if drifted else "OK", "overlay", overlay.summary(results))
    return {r.patch.id: r.status.value for r in results}


def diagnose(
    model_dir: str | Path,
    gpu_mem: float | None = None,
    gpus: int = 1,
    tp: int = 1,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    kv_dtype: str = "auto",
    utilization: float = 0.92,
    language_model_only: bool = False,
    check_overlay: bool = True,
    enable_lora: bool = False,
    dtype: str = "auto",
    max_num_batched_tokens: int | None = None,
    enforce_eager: bool = False,
    max_loras: int = 1,
    max_lora_rank: int = 16,
) -> Report:
    """Every check on the folder, each problem one finding (a broken input never stops the others)."""
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
    check_files(report, folder, shape, language_model_only)
    tensors = read_weights(report, folder)
    if not tensors and not any(f.check == "weights" for f in report.findings):
        report.add("WARN", "weights", "no *.safetensors in the folder: the weight plan below is empty")
    if config is not None:
        check_exl3(report, folder, shape, tensors, tp)
    counts = {t: shape.layer_types.count(t) for t in sorted(set(shape.layer_types))}
    report.add("OK", "layers", ", ".join(f"{n} {t}" for t, n in counts.items()) or "no layer_types (not hybrid)")
    if check_overlay:
        statuses = overlay_status(report)
        if config is not None:
            check_compiled_mode(report, shape, enable_lora, dtype, statuses.get("P4"))
            check_moe_lora(report, shape, enable_lora, statuses.get("P5"))
            check_moe_graphs(report, shape, enforce_eager, statuses.get("P7"))
            check_moe_stream(report, shape, statuses.get("P6"))
            check_moe_padding(report, shape, statuses.get("P9"))
            check_moe_release(report, shape, installed_version())
    report.plan = memory_plan(
        report,
        folder,
        shape,
        tensors,
        gpu_mem,
        gpus,
        Engine(
            gpu_mem or 0,
            tp=tp,
            utilization=utilization,
            max_model_len=max_model_len or shape.max_position or 4096,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_dtype=kv_dtype,
            dtype=activation_dtype(shape, dtype)[0],
            eager=enforce_eager,
            lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            language_model_only=language_model_only,
        ),
    )
    return report


def memory_plan(report: Report, folder: Path, shape: Shape, tensors: dict, gpu_mem, gpus, eng: Engine) -> dict:
    """The plan's terms, each with its formula; empty when config.json lacks what a term needs."""
    if not (shape.kv_ready and shape.state_ready):
        if shape.layer_types or any(f.check == "config" and f.level == "BLOCK" for f in report.findings):
            report.add("WARN", "memory", "no memory plan: config.json lacks the fields above")
        return {}
    kv_tok, kv_formula = kv_bytes_per_token(shape, eng.kv_dtype, eng.dtype)
    recurrent, conv, state_formula = state_bytes_per_sequence(shape, eng.dtype)
    per_seq_state = recurrent + conv
    weights = sum(t["bytes"] for t in tensors.values())
    exl3_weights = sum(
        t["bytes"] for n, t in tensors.items() if n.rsplit(".", 1)[-1] in ("trellis", "suh", "svh", "mcg", "mul1")
    )
    vision_weights = sum(t["bytes"] for n, t in tensors.items() if ".visual." in n or n.startswith("visual."))
    expert_weights = sum(t["bytes"] for n, t in tensors.items() if ".mlp.experts." in n)
    img_tokens, img_formula = image_tokens(report, folder, shape, eng.language_model_only)
    plan = {
        "kv_bytes_per_token": kv_tok,
        "kv_formula": kv_formula,
        "recurrent_state_bytes_per_sequence": recurrent,
        "conv_state_bytes_per_sequence": conv,
        "state_bytes_per_sequence": per_seq_state,
        "state_formula": state_formula,
        "weight_bytes": weights,
        "exl3_weight_bytes": exl3_weights,
        "vision_weight_bytes": vision_weights,
        "image_tokens_per_image": img_tokens,
        "image_formula": img_formula,
    }
    if shape.moe and shape.moe["experts"] and shape.moe["per_token"]:
        m = shape.moe
        plan.update(
            {
                "expert_weight_bytes": expert_weights,
                "active_expert_bytes_per_token": expert_weights * m["per_token"] // m["experts"],
                "expert_formula": f"routed experts {expert_weights / GIB:.3f} GiB; {m['per_token']} of "
                f"{m['experts']} experts read per token per layer",
            }
        )
    if not gpu_mem:
        return plan
    engine = memplan.plan(shape, tensors, eng, exl3=bool(exl3_weights))
    cap = engine["capacity"]
    pool = engine["available_kv_bytes"]
    plan.update(
        {
            "engine": engine["engine"],
            "terms": engine["terms"],
            "layout": engine["layout"],
            "capacity": cap,
            "kv_pool_bytes": pool,
            "context": eng.max_model_len,
            "kv_cache_tokens": cap["kv_cache_tokens"],
            "max_concurrency": cap["max_concurrency"],
            "max_concurrency_at_context": min(int(cap["max_concurrency"]), eng.max_num_seqs),
            "pin_kv_cache_memory": engine["pin_kv_cache_memory"],
            # the smallest --kv-cache-memory whose blocks cover --max-num-seqs (CUDA graphs: see the check below)
            "min_kv_cache_memory_for_graphs": eng.max_num_seqs
            * engine["layout"]["page_bytes"]
            * engine["layout"]["group_size"],
            "replicas": max(1, gpus // eng.tp),
            "pool_formula": "requested - " + " - ".join(k for k in engine["terms"] if k != "requested"),
            "concurrency_formula": cap["formula"],
        }
    )
    context = eng.max_model_len
    if pool <= 0:
        report.add(
            "BLOCK",
            "memory",
            f"weights, activations and CUDA graphs ({engine['non_kv_bytes'] / GIB:.2f} GiB) do not fit in "
            f"{gpu_mem:g} GiB x {eng.utilization:g} per GPU at TP {eng.tp}",
        )
    elif cap["max_concurrency"] < 1:
        report.add(
            "BLOCK",
            "memory",
            f"not one sequence of {context:,} tokens fits in the KV pool of {pool / GIB:.2f} GiB: the engine "
            "refuses to start; lower --max-model-len",
        )
    elif not eng.eager and cap["blocks"] < eng.max_num_seqs:
        # config/compilation.py (0.20.0-0.24.1, from vLLM #34094): with FULL decode graphs every decode sequence needs
        # one Mamba cache block, checked after the profiling run. Run 14 (H200, the 27B at full depth, pool pinned
        # at 16 GiB): "max_num_seqs (1024) exceeds available Mamba cache blocks (655)", the plan's 655 exactly
        report.add(
            "BLOCK",
            "memory",
            f"the KV pool of {pool / GIB:.2f} GiB holds {cap['blocks']:,} cache blocks and --max-num-seqs is "
            f"{eng.max_num_seqs:,}: with CUDA graphs each decode sequence needs one Mamba cache block, so the "
            f'engine stops after its profiling run ("max_num_seqs ({eng.max_num_seqs}) exceeds available Mamba '
            f'cache blocks ({cap["blocks"]})"); pass --max-num-seqs {cap["blocks"]} or less, give it more memory, '
            "or use --enforce-eager",
        )
    else:
        report.add(
            "OK",
            "memory",
            f"KV pool {pool / GIB:.2f} GiB per GPU: {cap['kv_cache_tokens']:,} tokens, concurrency "
            f"{cap['max_concurrency']:.2f}x at {context:,} tokens; after the first start pin the engine's own "
            "figure with --kv-cache-memory (it skips profiling and survives other processes' memory)",
        )
    return plan


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
            f"vision {p['vision_weight_bytes'] / GIB:,.3f} GiB)"
        )
        lines.append(f"  image tokens        {p['image_formula']}")
        if "expert_formula" in p:
            lines.append(
                f"  experts             {p['active_expert_bytes_per_token'] / MIB:,.1f} MiB read per token = "
                f"{p['expert_formula']}"
            )
        if "kv_pool_bytes" in p:
            lines.append(f"  engine              {p['engine']['defaults']}")
            for name, t in p["terms"].items():
                sign = "" if name == "requested" else "- "
                lines.append(f"  {sign + name:<19} {t['gib']:>7.3f} GiB = {t['formula']} [{t['basis']}]")
            lines.append(f"  = KV pool           {p['kv_pool_bytes'] / GIB:7.3f} GiB per GPU")
            lines.append(f"  KV layout           {p['layout']['formula']}")
            lines.append(
                f"  capacity            {p['kv_cache_tokens']:,} tokens, concurrency {p['max_concurrency']:.2f}x at "
                f"{p['context']:,} tokens = {p['concurrency_formula']}"
            )
            lines.append(
                f"  pin after a start   --kv-cache-memory {p['pin_kv_cache_memory']:,} (this plan's pool less the "
                "engine's 150 MiB margin; prefer the figure the engine logs)"
            )
            if not p["engine"]["enforce_eager"]:
                lines.append(
                    f"  pin at least        --kv-cache-memory {p['min_kv_cache_memory_for_graphs']:,} with CUDA graphs "
                    f"(one Mamba cache block per sequence: {p['engine']['max_num_seqs']:,} x "
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
