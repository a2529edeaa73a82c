"""``hybrid-exl3-fixes doctor MODEL_DIR``: preflight for hybrid GDN (+EXL3) deployments.

Reads only the model folder's JSON files and the safetensors headers (no weights are loaded).
Findings are OK / WARN / BLOCK; exit 0 (all ok), 1 (warnings), 2 (a blocking problem).

The memory plan counts what a hybrid model really holds:
- per-token KV only in the full-attention layers:
  ``full_layers x kv_heads x head_dim x 2 (K and V) x bytes(kv dtype)``;
- per-sequence recurrent state in each linear-attention (GatedDeltaNet) layer, independent of context:
  ``value_heads x key_head_dim x value_head_dim x 4 bytes`` (fp32 state) plus the conv state
  ``(2 x key_dim + value_dim) x (conv_kernel - 1) x 2 bytes``;
- weights exactly as stored (EXL3 trellis, scales and markers counted from the safetensors headers).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .exl3 import HAD, splits_into_blocks

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
FLOAT16 = ("float16", "half")
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


def read_safetensors_headers(folder: Path) -> dict[str, dict]:
    """name -> {"dtype", "shape", "bytes", "file"} from every *.safetensors header."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            tensors[name] = {"dtype": info["dtype"], "shape": info["shape"], "bytes": end - start, "file": path.name}
    return tensors


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def kv_bytes_per_token(text: dict, kv_dtype: str) -> tuple[int, str]:
    layer_types = text.get("layer_types") or ["full_attention"] * text["num_hidden_layers"]
    full = sum(t == "full_attention" for t in layer_types)
    heads, dim = text["num_key_value_heads"], text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    width = 1 if kv_dtype.startswith("fp8") else 2
    return full * heads * dim * 2 * width, f"{full} full layers x {heads} KV heads x {dim} x 2 (K,V) x {width} B"


def state_bytes_per_sequence(text: dict) -> tuple[int, int, str]:
    layer_types = text.get("layer_types") or []
    linear = sum(t == "linear_attention" for t in layer_types)
    if not linear:
        return 0, 0, "no linear-attention layers"
    vh, kd, vd = text["linear_num_value_heads"], text["linear_key_head_dim"], text["linear_value_head_dim"]
    kh, kernel = text["linear_num_key_heads"], text.get("linear_conv_kernel_dim", 4)
    recurrent = linear * vh * kd * vd * 4
    conv = linear * (2 * kh * kd + vh * vd) * (kernel - 1) * 2
    return recurrent, conv, (f"{linear} linear layers x ({vh} value heads x {kd} x {vd} x 4 B recurrent "
                             f"+ {2 * kh * kd + vh * vd} conv channels x {kernel - 1} x 2 B)")


def image_tokens(folder: Path, config: dict) -> tuple[int, str]:
    vision = config.get("vision_config") or {}
    patch, merge = vision.get("patch_size", 16), vision.get("spatial_merge_size", 2)
    longest = DEFAULT_LONGEST_EDGE
    pre = folder / "preprocessor_config.json"
    if pre.exists():
        size = json.loads(pre.read_text()).get("size") or {}
        longest = size.get("longest_edge", longest)
    tokens = longest // (patch * merge) ** 2
    return tokens, f"longest_edge {longest:,} px / ({patch} x {merge})^2 = {tokens:,} tokens per image"


def check_exl3(report: Report, folder: Path, config: dict, tensors: dict[str, dict], tp: int) -> None:
    qcfg = config.get("quantization_config") or {}
    if qcfg.get("quant_method") != "exl3":
        report.add("OK", "quantization", f"not EXL3 ({qcfg.get('quant_method') or 'unquantized'})")
        return
    qfile = folder / "quantization_config.json"
    if not qfile.exists():
        report.add("BLOCK", "exl3", "config.json says EXL3 but quantization_config.json (tensor_storage) is missing")
        return
    storage = json.loads(qfile.read_text()).get("tensor_storage") or {}
    exl3 = {k: v for k, v in storage.items() if v.get("quant_format") == "exl3"}
    missing, shape_diff = [], []
    for prefix, entry in exl3.items():
        for name, info in (entry.get("stored_tensors") or {}).items():
            if name not in tensors:
                missing.append(name)
            elif "shape" in info and list(info["shape"]) != list(tensors[name]["shape"]):
                shape_diff.append(f"{name} {info['shape']} != {tensors[name]['shape']}")
        if f"{prefix}.trellis" not in tensors and f"{prefix}.trellis" not in missing:
            missing.append(f"{prefix}.trellis")
    if missing or shape_diff:
        report.add("BLOCK", "exl3", f"tensor_storage disagrees with the safetensors: {len(missing)} missing "
                   f"({', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}), {len(shape_diff)} shape differences "
                   f"({'; '.join(shape_diff[:2])})")
    else:
        report.add("OK", "exl3", f"{len(exl3)} EXL3 modules, every stored tensor present with its shape")
    head_exl3 = any(k.startswith("lm_head.") and k.endswith(".trellis") for k in tensors)
    if qcfg.get("head_bits") is not None and not head_exl3:
        report.add("BLOCK", "head_bits", f"head_bits = {qcfg['head_bits']} but lm_head is not stored as EXL3: aphrodite "
                   "treats lm_head as EXL3 whenever head_bits is set and will miss its trellis. Set head_bits to null")
    elif qcfg.get("head_bits") is None and head_exl3:
        report.add("BLOCK", "head_bits", "lm_head is stored as EXL3 but head_bits is null: aphrodite will load it as a "
                   "dense layer. Set head_bits to the head's bitrate")
    else:
        report.add("OK", "head_bits", f"head_bits = {qcfg.get('head_bits')} matches how lm_head is stored")
    text = text_config(config)
    key_dim = text.get("linear_num_key_heads", 0) * text.get("linear_key_head_dim", 0)
    value_dim = text.get("linear_num_value_heads", 0) * text.get("linear_value_head_dim", 0)
    bad = []
    for prefix in exl3:
        trellis = tensors.get(f"{prefix}.trellis")
        if trellis is None:
            continue
        fin, fout = trellis["shape"][0] * 16, trellis["shape"][1] * 16
        name = prefix.rsplit(".", 1)[-1]
        # fused GDN projections are split per section (q, k, v[, z]), each across the ranks
        sections = {"in_proj_qkv": [key_dim, key_dim, value_dim],
                    "in_proj_qkvz": [key_dim, key_dim, value_dim, value_dim]}.get(name)
        splits = sections if sections and sum(sections) == fout else [fout] if name in COLUMN else [fin] if name in ROW else []
        if fin % HAD or fout % HAD:
            bad.append(f"{prefix} {fin}x{fout} not 128-aligned")
            continue
        for split in splits:
            if not splits_into_blocks(split, tp):
                bad.append(f"{prefix}: {split} / TP {tp} = {split / tp:g} is not a multiple of {HAD}")
                break
    if bad:
        report.add("BLOCK", "tp-alignment", f"{len(bad)} EXL3 dimension(s) cut a 128-wide Hadamard block at TP={tp}: "
                   + "; ".join(bad[:3]))
    else:
        report.add("OK", "tp-alignment", f"every EXL3 dimension splits into 128-multiples at TP={tp}")


def activation_dtype(config: dict, dtype: str = "auto") -> tuple[str, str]:
    """The dtype the engine computes in, and where it comes from: ``--dtype``, else the config's
    (aphrodite's ``auto``; a float32 or absent config dtype gives bfloat16 on a GPU that has it)."""
    if dtype != "auto":
        return ("float16" if dtype in FLOAT16 else dtype), f"--dtype {dtype}"
    declared = config.get("dtype") or config.get("torch_dtype") or text_config(config).get("dtype") \
        or text_config(config).get("torch_dtype")
    if declared in ("bfloat16", "float16"):
        return declared, f"config.json dtype {declared}"
    return "bfloat16", f"config.json dtype {declared or 'not set'} (auto: bfloat16)"


def check_compiled_mode(report: Report, config: dict, enable_lora: bool, dtype: str = "auto",
                        p4_status: str | None = None) -> None:
    """The default compiled mode crashes on EXL3 Qwen3.5 GDN models only with float16 activations
    (an Inductor rewrite meets the bare cat EXL3's apply leaves when no cast follows; the overlay's P4
    removes it): OK for bfloat16, and for float16 where P4 runs or upstream fixed it; WARN otherwise.
    ``p4_status``: P4's status in this environment (None: the overlay could not be evaluated)."""
    qcfg = config.get("quantization_config") or {}
    arch = (config.get("architectures") or ["?"])[0]
    gdn = "linear_attention" in (text_config(config).get("layer_types") or [])
    if qcfg.get("quant_method") != "exl3" or not gdn or not arch.startswith("Qwen3_5"):
        return
    act, source = activation_dtype(config, dtype)
    if act != "float16":
        report.add("OK", "compiled-mode", f"{act} activations ({source}): the default compiled mode works "
                   f"(measured on aphrodite 0.21.0 with and without LoRA, {COMPILED_CRASH_DOC})")
    elif p4_status in ("APPLIED", "UPSTREAM_FIXED"):
        who = "the overlay's P4 is applied here" if p4_status == "APPLIED" else "the installed aphrodite fixed it"
        report.add("OK", "compiled-mode", f"float16 activations ({source}): the default compiled mode crashes on EXL3 "
                   f"GDN models unless the fused projection's outputs are joined behind an op boundary; {who} "
                   f"({COMPILED_CRASH_DOC})")
    else:
        lora = (" --enable-lora avoids it on 0.20/0.21 (separate GDN projections), not on 0.24." if enable_lora else
                " On 0.20/0.21 --enable-lora avoids it too (separate GDN projections).")
        report.add("WARN", "compiled-mode", f"float16 activations ({source}) and the overlay's P4 is not active "
                   f"({p4_status or 'overlay not evaluated'}): aphrodite's default compiled mode crashes on EXL3 GDN "
                   "models with \"CUDA error: an illegal memory access\" in the first profiling run (Inductor folds "
                   "the GDN split into the EXL3 concat and changes the strides one graph piece hands the next). "
                   f"Serve with --dtype bfloat16 (measured), or let the overlay's P4 run, or use --enforce-eager.{lora} "
                   f"{COMPILED_CRASH_DOC}")


def check_files(report: Report, folder: Path, config: dict, language_model_only: bool) -> None:
    arch = (config.get("architectures") or ["?"])[0]
    if arch in KNOWN_ARCHS:
        report.add("OK", "architecture", f"{arch}: {KNOWN_ARCHS[arch]}")
    else:
        report.add("WARN", "architecture", f"{arch} is not a hybrid GDN architecture this tool knows")
    if not any(all((folder / f).exists() for f in group) for group in TOKENIZER_SETS):
        report.add("BLOCK", "tokenizer", "no tokenizer: copy tokenizer.json (or vocab.json + merges.txt) and "
                   "tokenizer_config.json from the base model")
    if arch.endswith("ForConditionalGeneration"):
        missing = [f for f in PROCESSOR_FILES if not (folder / f).exists()]
        if not (folder / "vocab.json").exists() and (folder / "merges.txt").exists():
            missing.append("vocab.json")
        if missing and not language_model_only:
            report.add("BLOCK", "processor", f"missing {', '.join(missing)}: the engine fails with \"Can't load image "
                       f"processor\". Copy them from the base model ({config.get('_name_or_path') or 'the original repo'}), "
                       "or serve text only with --language-model-only")
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


def diagnose(model_dir: str | Path, gpu_mem: float | None = None, gpus: int = 1, tp: int = 1,
             max_model_len: int | None = None, max_num_seqs: int = 256, kv_dtype: str = "auto",
             utilization: float = 0.9, language_model_only: bool = False, check_overlay: bool = True,
             enable_lora: bool = False, dtype: str = "auto") -> Report:
    folder = Path(model_dir)
    report = Report(str(folder))
    cfg_path = folder / "config.json"
    if not folder.is_dir():
        report.add("BLOCK", "config", f"{folder} is not a folder")
        return report
    if not cfg_path.exists():
        report.add("BLOCK", "config", f"no config.json in {folder}: is this the model folder (the one with the .safetensors)?")
        return report
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        report.add("BLOCK", "config", f"config.json does not parse: {exc}")
        return report
    text = text_config(config)
    report.add("OK", "config", "config.json parses")
    check_files(report, folder, config, language_model_only)
    try:
        tensors = read_safetensors_headers(folder)
    except (OSError, ValueError, struct.error) as exc:
        report.add("BLOCK", "weights", f"a safetensors header does not read: {exc}")
        tensors = {}
    if not tensors:
        report.add("WARN", "weights", "no *.safetensors in the folder: the weight plan below is empty")
    check_exl3(report, folder, config, tensors, tp)
    layer_types = text.get("layer_types") or []
    counts = {t: layer_types.count(t) for t in sorted(set(layer_types))}
    report.add("OK", "layers", ", ".join(f"{n} {t}" for t, n in counts.items()) or "no layer_types (not hybrid)")
    if check_overlay:
        statuses = overlay_status(report)
        check_compiled_mode(report, config, enable_lora, dtype, statuses.get("P4"))

    kv_tok, kv_formula = kv_bytes_per_token(text, kv_dtype)
    recurrent, conv, state_formula = state_bytes_per_sequence(text)
    per_seq_state = recurrent + conv
    weights = sum(t["bytes"] for t in tensors.values())
    exl3_weights = sum(t["bytes"] for n, t in tensors.items() if n.rsplit(".", 1)[-1] in ("trellis", "suh", "svh", "mcg", "mul1"))
    vision_weights = sum(t["bytes"] for n, t in tensors.items() if ".visual." in n or n.startswith("visual."))
    img_tokens, img_formula = image_tokens(folder, config)
    plan = {
        "kv_bytes_per_token": kv_tok, "kv_formula": kv_formula,
        "recurrent_state_bytes_per_sequence": recurrent, "conv_state_bytes_per_sequence": conv,
        "state_bytes_per_sequence": per_seq_state, "state_formula": state_formula,
        "weight_bytes": weights, "exl3_weight_bytes": exl3_weights, "vision_weight_bytes": vision_weights,
        "image_tokens_per_image": img_tokens, "image_formula": img_formula,
    }
    if gpu_mem:
        used_weights = weights - (vision_weights if language_model_only else 0)
        image_reserve = 0 if language_model_only else img_tokens * kv_tok
        budget = gpu_mem * GIB * utilization * tp
        pool = budget - used_weights - image_reserve
        context = max_model_len or text.get("max_position_embeddings", 4096)
        per_seq = context * kv_tok + per_seq_state
        max_seqs = max(0, int(pool // per_seq)) if pool > 0 else 0
        plan.update({
            "gpu_budget_bytes": int(budget), "image_reservation_bytes": image_reserve, "kv_pool_bytes": int(pool),
            "context": context, "bytes_per_sequence_at_context": per_seq,
            "max_concurrency_at_context": min(max_seqs, max_num_seqs), "replicas": max(1, gpus // tp),
            "pool_formula": (f"{gpu_mem:g} GiB x {utilization:g} x TP {tp} - weights {used_weights / GIB:.2f} GiB "
                             f"- image reservation {image_reserve / GIB:.2f} GiB"),
            "concurrency_formula": f"pool / ({context:,} tokens x {kv_tok:,} B + {per_seq_state:,} B state)",
        })
        if pool <= 0:
            report.add("BLOCK", "memory", f"weights and the image reservation do not fit in {gpu_mem:g} GiB x {tp}")
        elif max_seqs < 1:
            report.add("BLOCK", "memory", f"not one sequence of {context:,} tokens fits in the KV pool")
        elif image_reserve > 0.25 * pool:
            report.add("WARN", "memory", f"the default image budget reserves {image_reserve / GIB:.2f} GiB of KV "
                       f"({img_formula}); lower size.longest_edge in preprocessor_config.json or serve text only")
        else:
            report.add("OK", "memory", f"KV pool {pool / GIB:.2f} GiB: {min(max_seqs, max_num_seqs)} sequences of {context:,} tokens")
    report.plan = plan
    return report


def render(report: Report) -> str:
    lines = [f"hybrid-exl3-fixes doctor: {report.model}"]
    lines += [f"  {f.level:<5} {f.check:<13} {f.message}" for f in report.findings]
    p = report.plan
    if p:
        lines.append("memory plan:")
        lines.append(f"  KV per token        {p['kv_bytes_per_token'] / 1024:,.1f} KiB   = {p['kv_formula']}")
        lines.append(f"  state per sequence  {p['state_bytes_per_sequence'] / MIB:,.2f} MiB   = {p['state_formula']}")
        lines.append(f"  weights             {p['weight_bytes'] / GIB:,.3f} GiB (EXL3 {p['exl3_weight_bytes'] / GIB:,.3f} GiB, "
                     f"vision {p['vision_weight_bytes'] / GIB:,.3f} GiB)")
        lines.append(f"  image tokens        {p['image_formula']}")
        if "kv_pool_bytes" in p:
            lines.append(f"  KV pool             {p['kv_pool_bytes'] / GIB:,.2f} GiB = {p['pool_formula']}")
            lines.append(f"  max concurrency     {p['max_concurrency_at_context']} at {p['context']:,} tokens = "
                         f"{p['concurrency_formula']} (capped by --max-num-seqs)")
    lines.append({0: "result: ok", 1: "result: warnings", 2: "result: blocking problems"}[report.exit_code])
    return "\n".join(lines)


def as_json(report: Report) -> str:
    return json.dumps({"model": report.model, "exit_code": report.exit_code,
                       "findings": [f.__dict__ for f in report.findings], "plan": report.plan}, indent=2)
