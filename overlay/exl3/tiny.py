"""Tiny synthetic EXL3 Qwen3.5 hybrid checkpoints, their exact dense twins and LoRA adapters.

No weights are downloaded: every EXL3 tensor is a random (always valid) trellis, and the dense
twin holds the weights the reference codec decodes from it, so a correct EXL3 implementation
must reproduce the dense model's outputs up to fp16 arithmetic.

Layout written under ``DIR``::

    exl3/       config.json (+quantization_config), quantization_config.json (tensor_storage),
                model.safetensors, tokenizer files, chat_template.jinja, generation_config.json
                                                             -> aphrodite, quantization="exl3"
    dense/      the same model with the decoded weights (float32), same tokenizer -> HF reference
    lora-a/, lora-b/   PEFT LoRA adapters (rank 8, non-zero B) over the EXL3 projections
    manifest.json      what was written (bits, codebook per layer, seed, modules)

Which projections are EXL3 follows exllamav3's Qwen3.5 layout: GDN ``in_proj_qkv`` (q+k+v
fused), ``in_proj_z``, ``out_proj``; attention ``q/k/v/o_proj``; MLP ``gate/up/down_proj``.
``in_proj_a``, ``in_proj_b``, ``conv1d``, ``A_log``, ``dt_bias``, norms, embeddings, lm_head and
the vision tower stay unquantized (lm_head: ``head_bits`` null, since aphrodite treats
``lm_head`` as EXL3 whenever ``head_bits`` is set).

What the EXL3 folder holds follows what exllamav3 1.6.5 writes for a Qwen3.5/3.6 source model
(``conversion/compile.py``, checked against its sources in tests/unit/test_exllamav3_layout.py):
- config.json is the source model's, with ``quantization_config`` added (and
  ``tie_word_embeddings`` false): its ``dtype`` stays the source's, ``bfloat16`` for every published
  Qwen3.5/3.6 model, so that is the default here (``dtype="float16"`` writes the checkpoints this
  project used before 2026-12-01);
- every non-tensor file of the source is copied: the chat template (``chat_template.jinja``, the
  Qwen3 family's ChatML with ``enable_thinking``), ``generation_config.json``, the tokenizer;
- unquantized tensors keep the source dtype where exllamav3 loads them with ``allow_bf16`` (the
  embedding, every RMSNorm weight, the GDN ``conv1d``, ``A_log``, ``dt_bias``) and become float16
  where it does not (the unquantized linears ``in_proj_a``/``in_proj_b``, an unquantized
  ``lm_head``); the GDN ``dt_bias``, ``A_log`` and output norm are bfloat16 in both dtypes (its
  GDN kernel and gated norm take nothing else).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

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
SPECIAL_TOKENS = {
    "<|image_pad|>": 500,
    "<|video_pad|>": 501,
    "<|vision_start|>": 502,
    "<|vision_end|>": 503,
    "<|endoftext|>": 504,
    "<|im_start|>": 505,
    "<|im_end|>": 506,
}
# Added (not special) tokens, as Qwen3-family tokenizers have them: the template writes them and a
# reasoning parser reads them back from the detokenized text.
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

# Named shapes (TinySpec.preset, make-tiny --preset); each stays 128-aligned per rank at TP=2.
PRESETS: dict[str, dict] = {
    "tiny": {},
    # a tiny MoE hybrid: 4 routed experts (2 active) and a shared expert, 256 wide each
    "tiny-moe": dict(
        experts=4,
        experts_per_tok=2,
        moe_intermediate=256,
        shared_intermediate=256,
        adapters=("lora-a", "lora-b", "lora-experts"),
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
        adapters=("lora-a", "lora-b", "lora-experts"),
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
    """What to write. Defaults: the tiny config of FACTS.md (loads in aphrodite 0.21, 128-aligned
    also per rank at TP=2)."""

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
    adapters: tuple[str, ...] = ("lora-a", "lora-b")
    max_position: int = 4096  # config's max_position_embeddings: aphrodite refuses a longer max_model_len
    dtype: str = "bfloat16"  # the config's dtype, as exllamav3 keeps the source model's (DTYPES)
    # text_config.mamba_ssm_dtype: every published Qwen3.5/3.6 config (dense and MoE) carries "float32", and
    # exllamav3 copies the source config; aphrodite keeps the GDN recurrent state in it (models/config.py,
    # Qwen3_5ForConditionalGenerationConfig). None leaves the field out (the state then follows ``dtype``)
    ssm_dtype: str | None = "float32"
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

    @classmethod
    def preset(cls, name: str, **overrides) -> TinySpec:
        """Named shapes. ``qwen3.6-27b``: the Qwen3.5/3.6-27B layer dimensions (hidden 5120,
        intermediate 17408, 24 heads / 4 KV heads of 256, GDN 16 key / 48 value heads of 128) with
        4 layers, a 32768-token vocabulary and 32768 positions, for benchmarks at realistic width.
        ``tiny-moe``: the tiny shape with a MoE MLP (4 routed experts, 2 active, and a shared expert),
        and a third adapter, ``lora-experts``, that also targets the routed experts. ``qwen3.6-35b-a3b``:
        the Qwen3.6-35B-A3B layer dimensions with 4 layers and 32 of its 256 experts (8 active), the
        same three adapters."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def codebook_for(self, index: int) -> str:
        return codec.CODEBOOKS[index % 3] if self.codebook == "mixed" else self.codebook


def _check(spec: TinySpec) -> None:
    for name in ("bits", "seed", "tp", "lora_rank", "max_position", "hidden", "intermediate", "vocab"):
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "seed" else 1):
            raise ValueError(
                f"{name} must be a {'non-negative' if name == 'seed' else 'positive'} integer, got {value!r}"
            )
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {spec.dtype!r}")
    if spec.ssm_dtype not in (None, "float32", *DTYPES):
        raise ValueError(f"ssm_dtype must be float32, {', '.join(DTYPES)} or None, got {spec.ssm_dtype!r}")
    if spec.codebook not in (*codec.CODEBOOKS, "mixed"):
        raise ValueError(f"codebook must be one of {codec.CODEBOOKS + ('mixed',)}, got {spec.codebook!r}")
    if not 1 <= spec.bits <= 8:
        raise ValueError(f"bits must be 1..8, got {spec.bits}")
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


def hf_config(spec: TinySpec) -> dict:
    rotary = 0.25
    half_rot = int(spec.head_dim * rotary) // 2
    # mrope: sum(mrope_section) == head_dim * partial_rotary_factor / 2 (256 -> [11, 11, 10])
    mrope = [half_rot // 3 + (i < half_rot % 3) for i in range(3)]
    text = {
        "model_type": "qwen3_5_text",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": len(spec.layer_types),
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "layer_types": list(spec.layer_types),
        "linear_num_key_heads": spec.gdn_key_heads,
        "linear_num_value_heads": spec.gdn_value_heads,
        "linear_key_head_dim": spec.gdn_head_dim,
        "linear_value_head_dim": spec.gdn_head_dim,
        "linear_conv_kernel_dim": 4,
        "attn_output_gate": True,
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "partial_rotary_factor": rotary,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": rotary,
            "mrope_section": mrope,
            "mrope_interleaved": True,
        },
        "eos_token_id": SPECIAL_TOKENS["<|endoftext|>"],
        "dtype": spec.dtype,
    }
    if spec.ssm_dtype is not None:
        text["mamba_ssm_dtype"] = spec.ssm_dtype
    if spec.experts:  # the fields of Qwen3.5/3.6-35B-A3B's text_config (transformers' Qwen3_5MoeTextConfig)
        del text["intermediate_size"]
        text.update(
            model_type="qwen3_5_moe_text",
            num_experts=spec.experts,
            num_experts_per_tok=spec.experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate,
            shared_expert_intermediate_size=spec.shared_intermediate,
            router_aux_loss_coef=0.001,
        )
    # deepstack_visual_indexes and hidden_act: exllamav3's Qwen3.5 config reader requires them
    # (read_qwen3_vl_vision_config, no default), as the published Qwen3.5 configs carry them.
    vision = {
        "model_type": "qwen3_5_vision",
        "depth": 1,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_heads": 2,
        "out_hidden_size": spec.hidden,
        "num_position_embeddings": 64,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
        "deepstack_visual_indexes": [],
        "hidden_act": "gelu_pytorch_tanh",
    }
    if spec.experts:
        vision["model_type"] = "qwen3_5_moe_vision"
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if spec.experts else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if spec.experts else "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": SPECIAL_TOKENS["<|image_pad|>"],
        "video_token_id": SPECIAL_TOKENS["<|video_pad|>"],
        "vision_start_token_id": SPECIAL_TOKENS["<|vision_start|>"],
        "vision_end_token_id": SPECIAL_TOKENS["<|vision_end|>"],
        "eos_token_id": SPECIAL_TOKENS["<|endoftext|>"],
        "tie_word_embeddings": False,
        "dtype": spec.dtype,
    }


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


# The image processor config a Qwen3.5 checkpoint ships; exllamav3's Qwen3.5 config reader opens it
# (read_qwen3_vl_pp_config) even for text-only use.
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


# The chat template, in the Qwen3 family's ChatML form as Qwen3.5/3.6 checkpoints ship it in
# chat_template.jinja (written for this project, not copied): system/user/assistant/tool turns,
# image and video parts as vision pads, tool calls as <tool_call> JSON, reasoning kept only for the
# assistant turns after the last user query, and ``enable_thinking=false`` closing an empty think
# block in the generation prompt so the model answers directly.
CHAT_TEMPLATE = r"""{%- macro render(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}<|vision_start|><|image_pad|><|vision_end|>
{%- elif part.type == 'video' or 'video' in part -%}<|vision_start|><|video_pad|><|vision_end|>
{%- elif 'text' in part -%}{{- part.text -}}
{%- endif -%}
{%- endfor -%}
{%- elif content is not none -%}{{- content | string -}}
{%- endif -%}
{%- endmacro -%}
{%- set system_first = messages and messages[0].role == 'system' -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if system_first -%}{{- render(messages[0].content) + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou may call one or more functions. Their signatures, one JSON object per line:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nFor each call, answer with a JSON object {"name": ..., "arguments": ...} ' -}}
{{- 'inside <tool_call></tool_call> tags.<|im_end|>\n' -}}
{%- elif system_first -%}
{{- '<|im_start|>system\n' + render(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
{%- set content = render(message.content) -%}
{%- if message.role == 'system' -%}
{%- if not loop.first -%}{{- '<|im_start|>system\n' + content + '<|im_end|>\n' -}}{%- endif -%}
{%- elif message.role == 'user' -%}
{{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' -%}
{%- if '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{{- '<|im_start|>assistant\n' -}}
{%- if loop.index0 > ns.last_query and reasoning -%}{{- '<think>\n' + reasoning + '\n</think>\n\n' -}}{%- endif -%}
{{- content -}}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- ('\n' if content or not loop.first else '') + '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
{{- (fn.arguments if fn.arguments is string else fn.arguments | tojson) + '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""
# generation_config.json as Qwen3-family checkpoints ship it: both end tokens, the family's
# recommended sampling (aphrodite's `--generation-config auto`, the default, takes these as the
# server's default sampling parameters).
GENERATION_CONFIG = {
    "eos_token_id": [SPECIAL_TOKENS["<|im_end|>"], SPECIAL_TOKENS["<|endoftext|>"]],
    "pad_token_id": SPECIAL_TOKENS["<|endoftext|>"],
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
}


def _tokenizer_files(dest: Path, vocab_size: int, max_length: int) -> None:
    """A byte-level tokenizer (256 byte tokens, fillers, the Qwen special and think tokens) built
    locally, the chat template and the generation config."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    named = {i: t for t, i in {**SPECIAL_TOKENS, **THINK_TOKENS}.items()}
    for i in range(len(vocab), vocab_size):
        vocab[named.get(i, f"<|extra_{i}|>")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in THINK_TOKENS])
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": max_length,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    (dest / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (dest / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))


def write_tiny(
    out_dir: str | os.PathLike, spec: TinySpec | None = None, device: str | None = None, dense: bool = True
) -> dict:
    """Write the checkpoint set; returns the manifest. Writes into a temporary sibling folder and
    renames it into place, so a failure leaves nothing half-written. ``device`` ("cuda"): pack the
    trellises and decode the dense twin there (the 27B-width preset takes ~11 min on two CPU cores);
    the random draws stay on the CPU generator, so the EXL3 tensors are the same either way.
    ``dense=False``: no dense/ twin (benchmarks, which never read it; 7 GB at 27B widths)."""
    import torch
    from safetensors.torch import save_file

    spec = spec or TinySpec()
    _check(spec)
    return write_staged(out_dir, lambda tmp: _write(tmp, spec, torch, save_file, device, dense))


def write_staged(out_dir: str | os.PathLike, write) -> dict:
    """``write(tmp)`` into a temporary sibling of ``out_dir``, then rename it into place: a failure
    leaves nothing. ``out_dir`` must be new or empty."""
    out = Path(out_dir)
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise FileExistsError(f"{out} exists and is not a folder; choose a new folder")
        if any(out.iterdir()):
            raise FileExistsError(f"{out} exists and is not empty; choose a new folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as exc:
        raise FileExistsError(f"cannot create {out}: {exc.strerror or exc}; choose a folder you can write to") from None
    try:
        manifest = write(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class Draw:
    """Random tensors for the unquantized weights, drawn from one generator in call order (so a
    checkpoint is a function of its seed), on ``device`` (the streaming writer draws on the GPU)."""

    def __init__(self, gen, torch, device=None):
        self.gen, self.torch, self.device = gen, torch, device

    def randn(self, *shape, std=0.02, dtype=None):
        t = self.torch
        return (t.randn(*shape, generator=self.gen, device=self.device) * std).to(dtype or t.float16)

    def ones(self, *shape, dtype=None):
        return self.torch.ones(*shape, dtype=dtype or self.torch.float16, device=self.device)

    def log_uniform(self, n, low, high):
        t = self.torch
        return t.log(t.empty(n, device=self.device).uniform_(low, high, generator=self.gen))


def _global_state(spec: TinySpec, cfg: dict, draw: Draw) -> dict:
    """The unquantized tensors outside the decoder layers (vision tower, embedding, final norm, an
    unquantized lm_head), in the dtypes exllamav3 writes them (module docstring)."""
    t = draw.torch
    keep = getattr(t, spec.dtype)
    rnd = draw.randn
    v = cfg["vision_config"]
    state = {
        "model.visual.patch_embed.proj.weight": rnd(v["hidden_size"], 3, 2, 16, 16),
        "model.visual.patch_embed.proj.bias": rnd(v["hidden_size"]),
        "model.visual.pos_embed.weight": rnd(v["num_position_embeddings"], v["hidden_size"]),
        "model.visual.merger.norm.weight": draw.ones(v["hidden_size"]),
        "model.visual.merger.norm.bias": rnd(v["hidden_size"]),
        "model.visual.merger.linear_fc1.weight": rnd(4 * v["hidden_size"], 4 * v["hidden_size"]),
        "model.visual.merger.linear_fc1.bias": rnd(4 * v["hidden_size"]),
        "model.visual.merger.linear_fc2.weight": rnd(spec.hidden, 4 * v["hidden_size"]),
        "model.visual.merger.linear_fc2.bias": rnd(spec.hidden),
        "model.language_model.embed_tokens.weight": rnd(spec.vocab, spec.hidden, std=1.0, dtype=keep),
        "model.language_model.norm.weight": rnd(spec.hidden, std=0.1, dtype=keep),
    }
    if spec.head_bits is None:
        state["lm_head.weight"] = rnd(spec.vocab, spec.hidden, std=0.1)
    b = "model.visual.blocks.0."
    h = v["hidden_size"]
    for name, shape in {"norm1": (h,), "norm2": (h,)}.items():
        state[b + name + ".weight"] = draw.ones(*shape)
        state[b + name + ".bias"] = rnd(*shape)
    for name, (o, i) in {
        "attn.qkv": (3 * h, h),
        "attn.proj": (h, h),
        "mlp.linear_fc1": (v["intermediate_size"], h),
        "mlp.linear_fc2": (h, v["intermediate_size"]),
    }.items():
        state[b + name + ".weight"] = rnd(o, i)
        state[b + name + ".bias"] = rnd(o)
    return state


def _layer_state(spec: TinySpec, n: int, kind: str, draw: Draw) -> dict:
    """One decoder layer's unquantized tensors, in the dtypes exllamav3 writes them: ``keep`` (the
    config's dtype) for what its loaders read with ``allow_bf16`` -- RMSNorm weights, the GDN conv1d
    --, float16 for the unquantized linears, bfloat16 for the GDN dt_bias, A_log and output norm."""
    t = draw.torch
    keep = getattr(t, spec.dtype)
    rnd = draw.randn
    conv_dim = 2 * spec.gdn_key_heads * spec.gdn_head_dim + spec.gdn_value_heads * spec.gdn_head_dim
    p = f"model.language_model.layers.{n}."
    state = {
        p + "input_layernorm.weight": rnd(spec.hidden, std=0.1, dtype=keep),
        p + "post_attention_layernorm.weight": rnd(spec.hidden, std=0.1, dtype=keep),
    }
    if kind == "linear_attention":
        vh = spec.gdn_value_heads
        # bfloat16, as published Qwen3.5 checkpoints and exllamav3's output store them: exllamav3's
        # GDN kernel takes dt_bias only as bfloat16 and A_log as float32 or bfloat16 (gdn.cu), its
        # gated RMS norm a float32 or bfloat16 weight (norm.cu)
        state[p + "linear_attn.dt_bias"] = draw.ones(vh, dtype=t.bfloat16)
        state[p + "linear_attn.A_log"] = draw.log_uniform(vh, 1, 16).to(t.bfloat16)
        state[p + "linear_attn.conv1d.weight"] = rnd(conv_dim, 1, 4, std=0.3, dtype=keep)
        state[p + "linear_attn.norm.weight"] = (1 + rnd(spec.gdn_head_dim, std=0.1, dtype=t.float32)).to(t.bfloat16)
        state[p + "linear_attn.in_proj_a.weight"] = rnd(vh, spec.hidden, std=0.05)
        state[p + "linear_attn.in_proj_b.weight"] = rnd(vh, spec.hidden, std=0.05)
    else:
        state[p + "self_attn.q_norm.weight"] = rnd(spec.head_dim, std=0.1, dtype=keep)
        state[p + "self_attn.k_norm.weight"] = rnd(spec.head_dim, std=0.1, dtype=keep)
    if spec.experts:  # the router and the shared expert's gate: unquantized linears (float16, as exllamav3)
        state[p + "mlp.gate.weight"] = rnd(spec.experts, spec.hidden, std=0.5)
        state[p + "mlp.shared_expert_gate.weight"] = rnd(1, spec.hidden, std=0.1)
    return state


def _base_state(spec: TinySpec, cfg: dict, gen, torch) -> dict:
    """Every unquantized tensor with the shapes of HF's Qwen3_5(Moe)ForConditionalGeneration."""
    draw = Draw(gen, torch)
    state = _global_state(spec, cfg, draw)
    for n, kind in enumerate(spec.layer_types):
        state.update(_layer_state(spec, n, kind, draw))
    return state


def _write(tmp: Path, spec: TinySpec, torch, save_file, device: str | None = None, dense: bool = True) -> dict:
    gen = torch.Generator().manual_seed(spec.seed)
    cfg = hf_config(spec)
    base = _base_state(spec, cfg, gen, torch)
    exl3_state = dict(base)
    dense_state = {k: v.to(torch.float32) for k, v in base.items()}
    storage: dict[str, dict] = {}
    codebooks: dict[str, str] = {}
    projections = [(n, *p) for n, kind in enumerate(spec.layer_types) for p in layer_projections(spec, kind)]
    index = 0  # the codebook cycle of --codebook mixed runs over the projections that are not routed experts
    for n, suffix, fin, fout in progress(projections, "EXL3 projections"):
        prefix = f"model.language_model.layers.{n}.{suffix}"
        if ".experts." in suffix:
            cb = spec.expert_codebook
        else:
            cb, index = spec.codebook_for(index), index + 1
        codebooks[prefix] = cb
        tensors = codec.random_exl3_linear(fin, fout, spec.bits, cb, gen, device=device)
        if dense:
            dense_state[prefix + ".weight"] = codec.dense_weight(tensors, spec.bits, device).t().contiguous().cpu()
        for name, tensor in tensors.items():
            exl3_state[f"{prefix}.{name}"] = tensor
        storage[prefix] = exl3_storage_entry(exl3_state, prefix, spec.bits, cb)

    if dense and spec.experts:
        fuse_experts(dense_state, spec, torch)
    add_leaf_entries(storage, exl3_state)
    exl3_dir, dense_dir = tmp / "exl3", tmp / "dense"
    for d in (exl3_dir, dense_dir) if dense else (exl3_dir,):
        folder_files(d, spec)
    write_configs(exl3_dir, spec, cfg, storage)
    save_file(exl3_state, str(exl3_dir / "model.safetensors"), metadata={"format": "pt"})
    if dense:
        (dense_dir / "config.json").write_text(json.dumps({**cfg, "dtype": "float32"}, indent=2))
        save_file(dense_state, str(dense_dir / "model.safetensors"), metadata={"format": "pt"})

    adapters = {}
    for a, name in enumerate(spec.adapters):
        adapters[name] = _write_adapter(
            tmp / name, spec, torch, save_file, torch.Generator().manual_seed(spec.seed * 1000 + a + 1)
        )
    manifest = {
        "spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in spec.__dict__.items()},
        "codebooks": codebooks,
        "exl3_modules": sorted(k for k, v in storage.items() if v.get("quant_format") == "exl3"),
        "adapters": adapters,
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def progress(items: list, what: str):
    """``items`` with a progress bar on stderr once the work has taken 2 s (tqdm's ``delay``; the
    27B-width preset takes minutes on a CPU); the plain list when tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=f"make-tiny: {what}", unit="", delay=2, file=sys.stderr, leave=False)


def fuse_experts(dense_state: dict, spec: TinySpec, torch) -> None:
    """The dense twin's routed experts in transformers' layout (Qwen3_5MoeExperts): per layer one
    ``mlp.experts.gate_up_proj`` (experts, 2 x intermediate, hidden), gate rows first, and one
    ``mlp.experts.down_proj`` (experts, hidden, intermediate), from the per-expert weights."""
    for n in range(len(spec.layer_types)):
        p = f"model.language_model.layers.{n}.mlp.experts"
        take = [
            {w: dense_state.pop(f"{p}.{e}.{w}.weight") for w in ("gate_proj", "up_proj", "down_proj")}
            for e in range(spec.experts)
        ]
        dense_state[f"{p}.gate_up_proj"] = torch.stack([torch.cat([t["gate_proj"], t["up_proj"]]) for t in take])
        dense_state[f"{p}.down_proj"] = torch.stack([t["down_proj"] for t in take])


def exl3_storage_entry(state: dict, prefix: str, bits: int, codebook: str) -> dict:
    """tensor_storage's entry for one EXL3 linear, as exllamav3 writes it."""
    entry = {"stored_tensors": stored_tensor_info(state, prefix), "quant_format": "exl3", "bits_per_weight": bits}
    if codebook == "mul1":
        entry["mul1_multiplier"] = codec.MUL1_MULT
    elif codebook == "mcg":
        entry["mcg_multiplier"] = codec.MCG_MULT
    return entry


def add_leaf_entries(storage: dict, state: dict) -> None:
    """exllamav3 lists every leaf module in tensor_storage, unquantized ones with stored_tensors only."""
    modules = {k.rsplit(".", 1)[0] for k in state}
    leaves = {m for m in modules if not any(o.startswith(m + ".") for o in modules)}
    for leaf in sorted(leaves - set(storage)):
        storage[leaf] = {"stored_tensors": stored_tensor_info(state, leaf)}


def folder_files(folder: Path, spec: TinySpec) -> None:
    """The non-tensor files of a model folder: tokenizer, chat template, generation and processor configs."""
    folder.mkdir()
    _tokenizer_files(folder, spec.vocab, spec.max_position)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))


def write_configs(folder: Path, spec: TinySpec, cfg: dict, storage: dict) -> None:
    """config.json with quantization_config, and quantization_config.json with tensor_storage."""
    quant_cfg = {
        "quant_method": "exl3",
        "version": "1.6.5",
        "bits": float(spec.bits),
        "head_bits": spec.head_bits,
        "codebook": spec.codebook,
        "calibration": {"synthetic": True, "seed": spec.seed},
    }
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant_cfg}, indent=2))
    (folder / "quantization_config.json").write_text(json.dumps({**quant_cfg, "tensor_storage": storage}, indent=2))


def stored_tensor_info(state: dict, prefix: str) -> dict:
    """tensor_storage's ``stored_tensors`` for one module, in exllamav3's form (dtype as ``str(torch dtype)``)."""
    return {
        name: {"shape": list(t.shape), "n_bytes": t.numel() * t.element_size(), "dtype": str(t.dtype)}
        for name, t in sorted(state.items())
        if name.rsplit(".", 1)[0] == prefix
    }


def _write_adapter(dest: Path, spec: TinySpec, torch, save_file, gen) -> list[str]:
    """A PEFT LoRA adapter over the EXL3 projections named in ``spec.lora_targets``. In a MoE model the
    routed experts are left out, except by the adapter named ``lora-experts`` (keys per expert, the
    form aphrodite's LoRA loader reads expert adapters in; transformers' fused experts have no such
    modules, so it has no HF + PEFT reference: it exists to be refused or served by aphrodite)."""
    dest.mkdir()
    state = {}
    with_experts = dest.name == "lora-experts"
    for n, kind in enumerate(spec.layer_types):
        for suffix, fin, fout in layer_projections(spec, kind):
            if suffix.split(".")[-1] not in spec.lora_targets or (".experts." in suffix and not with_experts):
                continue
            key = f"base_model.model.model.language_model.layers.{n}.{suffix}"
            state[key + ".lora_A.weight"] = (torch.randn(spec.lora_rank, fin, generator=gen) / fin**0.5).to(
                torch.float16
            )
            state[key + ".lora_B.weight"] = (torch.randn(fout, spec.lora_rank, generator=gen) * 0.05).to(torch.float16)
    save_file(state, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    (dest / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": spec.lora_rank,
                "lora_alpha": 2 * spec.lora_rank,
                "lora_dropout": 0.0,
                "bias": "none",
                "fan_in_fan_out": False,
                "target_modules": list(spec.lora_targets),
                "base_model_name_or_path": None,
                "inference_mode": True,
                "init_lora_weights": True,
                "use_rslora": False,
                "modules_to_save": None,
            },
            indent=2,
        )
    )
    return sorted(state)
