"""What a tiny checkpoint is: its spec (``TinySpec``, the presets), the HF config it gets and its projections
(the writer is tiny.py; the layout and sources are in its docstring)."""

from __future__ import annotations

from dataclasses import dataclass

from . import codec, splits_into_blocks

EXL3_SUFFIXES = (
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.out_proj",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


LORA_TARGETS = (
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


# the attention and GDN projections alone: the full-depth presets' lora-a
ATTENTION_TARGETS = tuple(t for t in LORA_TARGETS if t not in ("gate_proj", "up_proj", "down_proj"))

# The GDN gate projections (unquantized in EXL3 checkpoints; aphrodite fuses them into ``in_proj_ba``):
# adapters trained with megatron-swift or VeOmni for Qwen3.5/3.6 carry them (vLLM issue #40005 shows such a
# key list). The adapter named ``lora-ab`` targets them besides LORA_TARGETS.
GDN_GATE_TARGETS = ("in_proj_a", "in_proj_b")
ADAPTER_TARGETS = {"lora-ab": LORA_TARGETS + GDN_GATE_TARGETS}


SPECIAL_TOKENS = {
    "<|image_pad|>": 500,
    "<|video_pad|>": 501,
    "<|vision_start|>": 502,
    "<|vision_end|>": 503,
    "<|endoftext|>": 504,
    "<|im_start|>": 505,
    "<|im_end|>": 506,
}
THINK_TOKENS = {"<think>": 507, "</think>": 508}
DTYPES = ("bfloat16", "float16")


# The Qwen3.6-35B-A3B layer (its published config.json): attention, GatedDeltaNet and expert widths, 8 active
# experts of 512 and a shared expert of 512; its 4-layer preset here and the full-depth one (stream.py) add
# the depth, vocabulary and expert count
QWEN36_35B_A3B_LAYER = dict(
    hidden=2048,
    heads=16,
    kv_heads=2,
    head_dim=256,
    gdn_key_heads=16,
    gdn_value_heads=32,
    gdn_head_dim=128,
    experts_per_tok=8,
    moe_intermediate=512,
    shared_intermediate=512,
)


# The vision tower's sizes: "published" as huggingface.co/Qwen/Qwen3.6-27B's config.json vision_config has them
# (depth 27, hidden_size 1152, intermediate_size 4304, num_heads 16, num_position_embeddings 2304; the 35B-A3B's
# are the same), "tiny" one block of width 128
VISION_TOWERS: dict[str, dict] = {
    "tiny": dict(depth=1, hidden_size=128, intermediate_size=256, num_heads=2, num_position_embeddings=64),
    "published": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, num_position_embeddings=2304),
}

# Named shapes (TinySpec.preset, make-tiny --preset); each stays 128-aligned per rank at TP=2.
PRESETS: dict[str, dict] = {
    "tiny": {},
    # a tiny MoE hybrid: 4 routed experts (2 active) and a shared expert, 256 wide each
    "tiny-moe": dict(
        experts=4,
        experts_per_tok=2,
        moe_intermediate=256,
        shared_intermediate=256,
        adapters=("lora-a", "lora-b", "lora-ab", "lora-experts", "lora-experts-3d"),
    ),
    # the Qwen3.6-35B-A3B layer dimensions (hidden 2048; 16 / 2 heads of 256; GDN 16 key / 32 value heads of
    # 128; experts 512 wide, 8 active, a shared expert of 512) with 4 layers and 32 routed experts instead of
    # 256, so that the dense twin stays small; its small-batch threshold (experts // active) is 4, which
    # sends 1, 2-4 and more rows down each of Exl3MoEMethod's three paths
    "qwen3.6-35b-a3b": dict(
        **QWEN36_35B_A3B_LAYER,
        vocab=32768,
        max_position=32768,
        experts=32,
        adapters=("lora-a", "lora-b", "lora-ab", "lora-experts", "lora-experts-3d"),
    ),
    "qwen3.6-27b": dict(
        hidden=5120,
        intermediate=17408,
        vocab=32768,
        heads=24,
        kv_heads=4,
        head_dim=256,
        gdn_key_heads=16,
        gdn_value_heads=48,
        gdn_head_dim=128,
        max_position=32768,
    ),
}


@dataclass
class TinySpec:
    """What to write. Defaults: a tiny Qwen3.5 hybrid (hidden 256, 4 layers [GDN x 3, attention], head_dim 256)
    that loads in aphrodite-engine 0.21.0 at TP 1 and 2 (every EXL3 dimension, and each TP=2 slice, a multiple of
    128: aphrodite's ``quantization/exl3.py`` refuses others; served on an H200, docs/gpu-runs/2026-11-30-run1)."""

    bits: int = 4
    codebook: str = "mcg"  # or "3inst", "mul1", or "mixed" (cycles through the three per layer)
    seed: int = 0
    hidden: int = 256
    intermediate: int = 512
    vocab: int = 512
    layer_types: tuple[str, ...] = ("linear_attention",) * 3 + ("full_attention",)
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 256
    gdn_key_heads: int = 2
    gdn_value_heads: int = 4
    gdn_head_dim: int = 128
    lora_rank: int = 8
    lora_targets: tuple[str, ...] = LORA_TARGETS
    tp: int = 2  # the largest tensor-parallel size the checkpoint must split evenly for
    adapters: tuple[str, ...] = ("lora-a", "lora-b", "lora-ab")
    max_position: int = 4096  # config's max_position_embeddings: aphrodite refuses a longer max_model_len
    dtype: str = "bfloat16"  # the config's dtype, as exllamav3 keeps the source model's (DTYPES)
    # text_config.mamba_ssm_dtype: every published Qwen3.5/3.6 config (dense and MoE) carries "float32", and
    # exllamav3 copies the source config; aphrodite keeps the GDN recurrent state in it (models/config.py,
    # Qwen3_5ForConditionalGenerationConfig). None leaves the field out (the state then follows ``dtype``)
    ssm_dtype: str | None = "float32"
    # text_config.mtp_num_hidden_layers (1 in every published config) and the bits exllamav3 gives the MTP
    # head (convert_model.py --mtp_bits, default 4; quantization_config.mtp_bits). aphrodite skips every
    # ``mtp.*`` tensor unless speculative decoding with MTP is asked for
    mtp_layers: int = 1
    mtp_bits: int = 4
    # MoE (Qwen3_5MoeForConditionalGeneration) when experts > 0: every layer's MLP is a router over
    # ``experts`` routed experts (``moe_intermediate`` wide, ``experts_per_tok`` active) plus a shared
    # expert (``shared_intermediate``) behind a sigmoid gate, as the published Qwen3.5/3.6-35B-A3B config
    # has it; ``intermediate`` is then unused
    experts: int = 0
    experts_per_tok: int = 2
    moe_intermediate: int = 256
    shared_intermediate: int = 256
    expert_codebook: str = "mcg"  # aphrodite's EXL3 MoE kernel takes mcg on every release (doctor)
    # lm_head as EXL3 at this bitrate (config head_bits); None keeps it a float16 linear
    head_bits: int | None = None
    # the vision tower: "tiny" (one block of width 128) or "published" (the published Qwen3.5/3.6 tower's
    # dimensions, VISION_TOWERS["published"]: ~0.43 B bfloat16 parameters, for the memory plan's vision rows)
    vision: str = "tiny"
    # an MTP head that agrees with the trunk's greedy continuation at this rate (0..1), the trunk's next token a
    # fixed function of the current one (checkpoint/mtpaccept.py); a tuple: one token pool a rate; None: every
    # tensor random
    mtp_acceptance: float | tuple[float, ...] | None = None

    @classmethod
    def preset(cls, name: str, **overrides) -> TinySpec:
        """Named shapes. ``qwen3.6-27b``: the Qwen3.5/3.6-27B layer dimensions (hidden 5120,
        intermediate 17408, 24 heads / 4 KV heads of 256, GDN 16 key / 48 value heads of 128) with
        4 layers, a 32768-token vocabulary and 32768 positions, for benchmarks at realistic width.
        ``tiny-moe``: the tiny shape with a MoE MLP (4 routed experts, 2 active, and a shared expert),
        and adapters that also target the routed experts: ``lora-experts`` (keys per expert) and
        ``lora-experts-3d`` (PEFT's ``target_parameters`` form on fused experts). ``qwen3.6-35b-a3b``:
        the Qwen3.6-35B-A3B layer dimensions with 4 layers and 32 of its 256 experts (8 active), the
        same adapters."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def codebook_for(self, index: int) -> str:
        return codec.CODEBOOKS[index % 3] if self.codebook == "mixed" else self.codebook


def _check(spec: TinySpec) -> None:
    for name in ("bits", "seed", "tp", "lora_rank", "max_position", "hidden", "intermediate", "vocab", "mtp_layers"):
        value = getattr(spec, name)
        zero_ok = name in ("seed", "mtp_layers")
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if zero_ok else 1):
            raise ValueError(f"{name} must be a {'non-negative' if zero_ok else 'positive'} integer, got {value!r}")
    if spec.mtp_layers and not 1 <= spec.mtp_bits <= 8:
        raise ValueError(f"mtp_bits must be 1..8, got {spec.mtp_bits}")
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {spec.dtype!r}")
    if spec.ssm_dtype not in (None, "float32", *DTYPES):
        raise ValueError(f"ssm_dtype must be float32, {', '.join(DTYPES)} or None, got {spec.ssm_dtype!r}")
    if spec.codebook not in (*codec.CODEBOOKS, "mixed"):
        raise ValueError(f"codebook must be one of {codec.CODEBOOKS + ('mixed',)}, got {spec.codebook!r}")
    if spec.vision not in VISION_TOWERS:
        raise ValueError(f"vision must be one of {', '.join(VISION_TOWERS)}, got {spec.vision!r}")
    if not 1 <= spec.bits <= 8:
        raise ValueError(f"bits must be 1..8, got {spec.bits}")
    if spec.head_bits is not None and not (isinstance(spec.head_bits, int) and 1 <= spec.head_bits <= 8):
        raise ValueError(f"head_bits must be 1..8 or None, got {spec.head_bits!r}")
    if spec.head_bits is not None and spec.vocab % codec.HAD:
        raise ValueError(f"vocab = {spec.vocab} is not a multiple of {codec.HAD}, which an EXL3 head needs")
    if spec.mtp_acceptance is not None:
        from .mtpaccept import check_rate

        check_rate(spec.mtp_acceptance)
        if not spec.mtp_layers or spec.head_bits is not None or spec.vocab < 509:
            raise ValueError(
                "mtp_acceptance needs an MTP head (mtp_layers >= 1), a float16 head (no head_bits) and the "
                f"tokenizer's special tokens (vocab >= 509); got mtp_layers={spec.mtp_layers}, "
                f"head_bits={spec.head_bits}, vocab={spec.vocab}"
            )
    if spec.hidden % codec.HAD:
        raise ValueError(f"hidden = {spec.hidden} is not a multiple of {codec.HAD} (every EXL3 dimension must be)")
    # Dimensions a tensor-parallel rank holds a slice of: column-parallel outputs and the
    # matching row-parallel inputs. The hidden size is never split.
    split = {
        "intermediate": spec.intermediate,
        "attention q (with output gate)": 2 * spec.heads * spec.head_dim,
        "attention k/v": spec.kv_heads * spec.head_dim,
        "GDN key dim": spec.gdn_key_heads * spec.gdn_head_dim,
        "GDN value dim": spec.gdn_value_heads * spec.gdn_head_dim,
    }
    if spec.experts:
        if not 1 <= spec.experts_per_tok <= spec.experts:
            raise ValueError(f"experts_per_tok must be 1..experts ({spec.experts}), got {spec.experts_per_tok}")
        if spec.expert_codebook not in codec.CODEBOOKS:
            raise ValueError(f"expert_codebook must be one of {codec.CODEBOOKS}, got {spec.expert_codebook!r}")
        del split["intermediate"]
        split.update(
            {
                "routed expert intermediate": spec.moe_intermediate,
                "shared expert intermediate": spec.shared_intermediate,
            }
        )
    for name, size in split.items():
        if not splits_into_blocks(size, spec.tp):
            raise ValueError(
                f"{name} = {size} is not a multiple of {codec.HAD} x TP {spec.tp} = {codec.HAD * spec.tp}: a "
                f"tensor-parallel split would cut a {codec.HAD}-wide Hadamard block"
            )


# The published configs make-tiny imitates, field by field (tests/unit/test_published_config.py compares
# them and names every deliberate difference; the copies are tests/data/published/*.json):
#   Qwen3.6-27B      https://huggingface.co/Qwen/Qwen3.6-27B/blob/main/config.json      (dense presets)
#   Qwen3.6-35B-A3B  https://huggingface.co/Qwen/Qwen3.6-35B-A3B/blob/main/config.json  (MoE presets)
# Fields every published Qwen3.5/3.6 text_config carries with one value, dense and MoE alike.
PUBLISHED_TEXT_FIXED = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "full_attention_interval": 4,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "linear_conv_kernel_dim": 4,
    "mtp_use_dedicated_embeddings": False,
    "pad_token_id": None,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "use_cache": True,
}
ROPE_THETA = 10000000
PARTIAL_ROTARY = 0.25
TRANSFORMERS_VERSION = "4.57.1"  # what the published configs were saved with


def hf_config(spec: TinySpec) -> dict:
    """config.json in the published form (the two configs above): every field they carry, with their value
    where it is not a dimension of the spec. Dense: Qwen3.6-27B's fields (``output_gate_type``,
    ``language_model_only``); MoE: Qwen3.6-35B-A3B's (``num_experts`` ... ``router_aux_loss_coef``,
    ``output_router_logits``; no ``output_gate_type``). ``mtp_num_hidden_layers`` is ``spec.mtp_layers``
    (1 as published; the MTP tensors are written as exllamav3 writes them: ``mtp_projections``)."""
    half_rot = int(spec.head_dim * PARTIAL_ROTARY) // 2
    # mrope: sum(mrope_section) == head_dim * partial_rotary_factor / 2 (256 -> [11, 11, 10], as published)
    mrope = [half_rot // 3 + (i < half_rot % 3) for i in range(3)]
    eos = SPECIAL_TOKENS["<|endoftext|>"]  # the published bos and eos (248044) are <|endoftext|>
    text = {
        **PUBLISHED_TEXT_FIXED,
        "bos_token_id": eos,
        "dtype": spec.dtype,
        "eos_token_id": eos,
        "head_dim": spec.head_dim,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "layer_types": list(spec.layer_types),
        "linear_key_head_dim": spec.gdn_head_dim,
        "linear_num_key_heads": spec.gdn_key_heads,
        "linear_num_value_heads": spec.gdn_value_heads,
        "linear_value_head_dim": spec.gdn_head_dim,
        "max_position_embeddings": spec.max_position,
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": spec.mtp_layers,
        "num_attention_heads": spec.heads,
        "num_hidden_layers": len(spec.layer_types),
        "num_key_value_heads": spec.kv_heads,
        "output_gate_type": "swish",
        "partial_rotary_factor": PARTIAL_ROTARY,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": mrope,
            "partial_rotary_factor": PARTIAL_ROTARY,
            "rope_theta": ROPE_THETA,
            "rope_type": "default",
        },
        "vocab_size": spec.vocab,
    }
    # text_config.mamba_ssm_dtype: aphrodite keeps the GDN recurrent state in it (models/config.py,
    # Qwen3_5ForConditionalGenerationConfig); None (a deliberate departure) leaves it to follow ``dtype``
    if spec.ssm_dtype is not None:
        text["mamba_ssm_dtype"] = spec.ssm_dtype
    if spec.experts:  # Qwen3.6-35B-A3B's text_config (transformers' Qwen3_5MoeTextConfig)
        del text["intermediate_size"], text["output_gate_type"]
        text.update(
            model_type="qwen3_5_moe_text",
            moe_intermediate_size=spec.moe_intermediate,
            num_experts=spec.experts,
            num_experts_per_tok=spec.experts_per_tok,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
            shared_expert_intermediate_size=spec.shared_intermediate,
        )
    # the vision tower: by default one block of a small width (the published depth 27, width 1152 are a deliberate
    # difference; spec.vision "published" writes them); deepstack_visual_indexes and hidden_act are required by
    # exllamav3's reader (read_qwen3_vl_vision_config, no default)
    vision = {
        "deepstack_visual_indexes": [],
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "initializer_range": 0.02,
        "model_type": "qwen3_5_moe" if spec.experts else "qwen3_5",
        **VISION_TOWERS[spec.vision],
        "out_hidden_size": spec.hidden,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    cfg = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if spec.experts else "Qwen3_5ForConditionalGeneration"],
        "image_token_id": SPECIAL_TOKENS["<|image_pad|>"],
        "model_type": "qwen3_5_moe" if spec.experts else "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": TRANSFORMERS_VERSION,
        "video_token_id": SPECIAL_TOKENS["<|video_pad|>"],
        "vision_config": vision,
        "vision_end_token_id": SPECIAL_TOKENS["<|vision_end|>"],
        "vision_start_token_id": SPECIAL_TOKENS["<|vision_start|>"],
    }
    if not spec.experts:  # Qwen3.6-27B's config carries it, Qwen3.6-35B-A3B's does not
        cfg["language_model_only"] = False
    return cfg


def mtp_projections(spec: TinySpec) -> list[tuple[str, int, int]]:
    """(name, in, out) of every EXL3 linear of the MTP head, as exllamav3 1.6.5 quantizes it at ``mtp_bits``
    (architecture/qwen3_5_mtp.py: ``mtp.fc``, 2 x hidden -> hidden, then per MTP layer a full-attention
    layer's q/k/v/o and MLP under ``mtp.layers.N``). Empty when ``spec.mtp_layers`` is 0 (exllamav3 then
    builds no MTP component)."""
    out = [("mtp.fc", 2 * spec.hidden, spec.hidden)] if spec.mtp_layers else []
    for n in range(spec.mtp_layers):
        out += [(f"mtp.layers.{n}.{s}", fin, fout) for s, fin, fout in layer_projections(spec, "full_attention")]
    return out


def layer_projections(spec: TinySpec, kind: str) -> list[tuple[str, int, int]]:
    """(suffix, in, out) of every EXL3 projection of one layer, in the order they are written: the
    attention or GDN projections, then the MLP's (dense; or each routed expert's, then the shared
    expert's)."""
    shapes = _linear_shapes(spec)
    wanted = "linear_attn." if kind == "linear_attention" else "self_attn."
    out = [(s, *shapes[s]) for s in EXL3_SUFFIXES if s.startswith(wanted)]
    if not spec.experts:
        return out + [(s, *shapes[s]) for s in EXL3_SUFFIXES if s.startswith("mlp.")]
    mlp = [("gate_proj", spec.hidden, None), ("up_proj", spec.hidden, None), ("down_proj", None, spec.hidden)]
    for owner, width in [
        *((f"mlp.experts.{e}", spec.moe_intermediate) for e in range(spec.experts)),
        ("mlp.shared_expert", spec.shared_intermediate),
    ]:
        out += [(f"{owner}.{name}", fin or width, fout or width) for name, fin, fout in mlp]
    return out


def _linear_shapes(spec: TinySpec) -> dict[str, tuple[int, int]]:
    """(in, out) of every EXL3 projection, by suffix."""
    q = 2 * spec.heads * spec.head_dim
    kv = spec.kv_heads * spec.head_dim
    k_gdn = spec.gdn_key_heads * spec.gdn_head_dim
    v_gdn = spec.gdn_value_heads * spec.gdn_head_dim
    return {
        "linear_attn.in_proj_qkv": (spec.hidden, 2 * k_gdn + v_gdn),
        "linear_attn.in_proj_z": (spec.hidden, v_gdn),
        "linear_attn.out_proj": (v_gdn, spec.hidden),
        "self_attn.q_proj": (spec.hidden, q),
        "self_attn.k_proj": (spec.hidden, kv),
        "self_attn.v_proj": (spec.hidden, kv),
        "self_attn.o_proj": (spec.heads * spec.head_dim, spec.hidden),
        "mlp.gate_proj": (spec.hidden, spec.intermediate),
        "mlp.up_proj": (spec.hidden, spec.intermediate),
        "mlp.down_proj": (spec.intermediate, spec.hidden),
    }
