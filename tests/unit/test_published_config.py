"""make-tiny's config.json against the published configs it imitates, field by field.

Every field the published config carries, make-tiny writes, and nothing else; every value is the published
one except the deliberate differences named below, each with its reason. The published configs are kept in
tests/data/published/ (their sources and how they were taken: tests/data/published/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybrid_exl3_fixes.checkpoint.stream import FULL_PRESETS, full_spec
from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
from hybrid_exl3_fixes.checkpoint.tinyspec import PRESETS, hf_config

PUBLISHED = Path(__file__).resolve().parents[1] / "data" / "published"

# text_config fields that are the model's dimensions: a small preset shrinks them (to fit a CPU test and a
# dense twin in HF transformers), the full-depth presets keep the published values (checked below)
TEXT_DIMENSIONS = {
    "hidden_size",
    "intermediate_size",
    "layer_types",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "vocab_size",
    "max_position_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
}
# token ids: make-tiny's tokenizer is small, so the same special tokens have other ids (checked by name below)
TEXT_TOKEN_IDS = {"bos_token_id", "eos_token_id"}
TOP_TOKEN_IDS = {"image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"}
TOKEN_NAMES = {
    "bos_token_id": "<|endoftext|>",
    "eos_token_id": "<|endoftext|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
# the vision tower: one small block (the published 27 blocks of 1152 would outweigh the tiny language model);
# out_hidden_size follows the language model's hidden size, as published
VISION_DIMENSIONS = {"depth", "hidden_size", "intermediate_size", "num_heads", "num_position_embeddings"}

DENSE = sorted(n for n in [*PRESETS, *FULL_PRESETS] if "moe" not in n and "a3b" not in n)
MOE = sorted(n for n in [*PRESETS, *FULL_PRESETS] if "moe" in n or "a3b" in n)


def spec_of(name: str) -> TinySpec:
    return full_spec(name) if name in FULL_PRESETS else TinySpec.preset(name)


def published_for(name: str) -> dict:
    return json.loads((PUBLISHED / ("qwen3.6-35b-a3b.json" if name in MOE else "qwen3.6-27b.json")).read_text())


@pytest.mark.parametrize("name", DENSE + MOE)
def test_every_published_field_with_its_value(name):
    ours, theirs = hf_config(spec_of(name)), published_for(name)
    assert set(ours) == set(theirs)
    assert set(ours["text_config"]) == set(theirs["text_config"])
    assert set(ours["vision_config"]) == set(theirs["vision_config"])
    assert ours["text_config"]["rope_parameters"].keys() == theirs["text_config"]["rope_parameters"].keys()
    for key in set(theirs) - {"text_config", "vision_config"} - TOP_TOKEN_IDS:
        assert ours[key] == theirs[key], key
    for key in set(theirs["text_config"]) - TEXT_DIMENSIONS - TEXT_TOKEN_IDS - {"rope_parameters"}:
        assert ours["text_config"][key] == theirs["text_config"][key], key
    rope, published_rope = ours["text_config"]["rope_parameters"], theirs["text_config"]["rope_parameters"]
    for key in set(published_rope) - {"mrope_section"}:
        assert rope[key] == published_rope[key], key
    for key in set(theirs["vision_config"]) - VISION_DIMENSIONS - {"out_hidden_size"}:
        assert ours["vision_config"][key] == theirs["vision_config"][key], key


@pytest.mark.parametrize("name", DENSE + MOE)
def test_the_differences_are_consistent_with_the_model(name):
    text = hf_config(spec_of(name))["text_config"]
    cfg = hf_config(spec_of(name))
    assert text["num_hidden_layers"] == len(text["layer_types"])
    assert text["layer_types"][3::4] == ["full_attention"] * (len(text["layer_types"]) // 4)
    # mrope covers the rotary half of the rotary dims, as published (256 x 0.25 / 2 = 32 = 11 + 11 + 10)
    assert sum(text["rope_parameters"]["mrope_section"]) == text["head_dim"] * text["partial_rotary_factor"] / 2
    assert cfg["vision_config"]["out_hidden_size"] == text["hidden_size"]


def test_the_full_depth_presets_keep_the_published_dimensions():
    for name, published in (("qwen3.6-27b-full", "qwen3.6-27b"), ("qwen3.6-35b-a3b-full", "qwen3.6-35b-a3b")):
        ours = hf_config(full_spec(name) if name in FULL_PRESETS else TinySpec.preset(name))["text_config"]
        theirs = json.loads((PUBLISHED / f"{published}.json").read_text())["text_config"]
        for key in TEXT_DIMENSIONS & set(theirs):
            assert ours[key] == theirs[key], (name, key)
        assert ours["rope_parameters"] == theirs["rope_parameters"]


def test_every_preset_keeps_the_state_in_float32_and_one_mtp_layer():
    for name in DENSE + MOE:
        text = hf_config(spec_of(name))["text_config"]
        assert text["mamba_ssm_dtype"] == "float32" and text["mtp_num_hidden_layers"] == 1, name


def test_token_ids_name_the_published_tokens(tmp_path):
    """The ids differ (a 512-token vocabulary); the tokens they name are the published ones."""
    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    folder = tmp_path / "t" / "exl3"
    cfg = json.loads((folder / "config.json").read_text())
    vocab = json.loads((folder / "tokenizer.json").read_text())
    ids = {t["id"]: t["content"] for t in vocab["added_tokens"]}
    fields = {**{k: cfg[k] for k in TOP_TOKEN_IDS}, **{k: cfg["text_config"][k] for k in TEXT_TOKEN_IDS}}
    assert {k: ids[v] for k, v in fields.items()} == TOKEN_NAMES
    # and the written config.json is hf_config's plus the quantizer's section, nothing else
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == hf_config(TinySpec())
