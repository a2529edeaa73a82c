"""The non-tensor files of a tiny checkpoint, as exllamav3 copies them from the source model: the processor
config, the chat template, generation_config.json, the tokenizer, config.json and quantization_config.json."""

from __future__ import annotations

import json
from pathlib import Path

from .tinyspec import SPECIAL_TOKENS, THINK_TOKENS, TinySpec

# The image and video processor configs every published Qwen3.5/3.6 repository ships (Qwen3.6-27B,
# Qwen3.6-35B-A3B: preprocessor_config.json, video_preprocessor_config.json), with their values; exllamav3
# copies them, its Qwen3.5 config reader opens the first (read_qwen3_vl_pp_config), and aphrodite's
# multimodal start-up ("Can't load image processor") needs both unless --language-model-only.
_VISION_PROCESSOR = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
}
PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    **_VISION_PROCESSOR,
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
VIDEO_PREPROCESSOR = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    **_VISION_PROCESSOR,
    "video_processor_type": "Qwen3VLVideoProcessor",
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


def folder_files(folder: Path, spec: TinySpec) -> None:
    """The non-tensor files of a model folder: tokenizer, chat template, generation and processor configs."""
    folder.mkdir()
    _tokenizer_files(folder, spec.vocab, spec.max_position)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR, indent=2))


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
    if spec.mtp_layers:  # exllamav3's compile.py adds it when the model has an MTP component
        quant_cfg["mtp_bits"] = float(spec.mtp_bits)
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant_cfg}, indent=2))
    (folder / "quantization_config.json").write_text(json.dumps({**quant_cfg, "tensor_storage": storage}, indent=2))
