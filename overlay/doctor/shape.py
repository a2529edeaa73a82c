"""The model's shape as doctor reads it from config.json (text_config for the multimodal classes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .base import CONFIG_DTYPES, Report
from .modelfiles import (
    Fields,
    Problem,
    describe,
    is_int,
    read_json_object,
)


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
    vision: dict | None = None  # VISION_FIELDS' keys, deepstack (merger count), out_hidden
    declared_dtype: str | None = None
    name_or_path: str | None = None
    moe: dict | None = None  # experts, per_token, intermediate, shared_intermediate (MoE configs)
    vocab: int | None = None  # these three size the memory plan's activation and LoRA terms only:
    intermediate: int | None = None  # read without complaint (a missing one leaves its term smaller)
    ssm_dtype: str | None = None  # text_config.mamba_ssm_dtype: the GDN state's dtype when given
    ssm_source: str = "mamba_ssm_dtype"  # or the engine flag that replaced it

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
# the GDN recurrent state dtypes a config may name (aphrodite config/cache.py MambaDType, less "auto")
SSM_DTYPES = ("float32", "bfloat16", "float16")
# config.json vision_config: plan key -> field. Defaults: the published Qwen3.5/3.6 vision tower
# (huggingface.co/Qwen/Qwen3.6-27B config.json vision_config: depth 27, hidden_size 1152, intermediate_size 4304,
# num_heads 16, patch_size 16, temporal_patch_size 2, spatial_merge_size 2, deepstack_visual_indexes [])
VISION_FIELDS = {
    "patch": "patch_size",
    "merge": "spatial_merge_size",
    "temporal": "temporal_patch_size",
    "channels": "in_channels",
    "depth": "depth",
    "width": "hidden_size",
    "intermediate": "intermediate_size",
    "heads": "num_heads",
}
VISION_DEFAULTS = dict(patch=16, merge=2, temporal=2, channels=3, depth=27, width=1152, intermediate=4304, heads=16)


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
    shape.ssm_dtype = ssm if ssm in SSM_DTYPES else None
    if ssm is not None and ssm not in SSM_DTYPES and ssm != "auto":
        text.problems.append(
            f"{text.where}: mamba_ssm_dtype is {describe(ssm)}, not one the engine takes ({', '.join(SSM_DTYPES)}, "
            "auto: aphrodite config/cache.py MambaDType)" + FIX_CONFIG
        )
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
        # the encoder's dimensions size the profiling run's vision term (arithmetic.vision_encoder); a field left out
        # takes the published Qwen3.5/3.6 vision tower's value (VISION_DEFAULTS)
        shape.vision = {
            key: v.positive_int(name, required=False) or VISION_DEFAULTS[key] for key, name in VISION_FIELDS.items()
        }
        stack = vision.get("deepstack_visual_indexes")
        shape.vision["deepstack"] = len(stack) if isinstance(stack, list) else 0
        shape.vision["out_hidden"] = v.positive_int("out_hidden_size", required=False) or shape.hidden or 0
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
