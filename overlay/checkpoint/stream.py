"""Full-depth EXL3 checkpoints for benchmarks, written layer by layer.

A published Qwen3.5/3.6 model quantized by exllamav3 is several to tens of GB; writing one the way
``tiny.py`` writes a tiny model (every tensor in host memory, the dense twin decoded) would need that
much host memory and hours of CPU time. Any bit pattern is a valid EXL3 trellis, so here the trellises
and every unquantized tensor are drawn on ``device`` (the GPU) from a generator seeded by the spec, one
decoder layer at a time, and each layer is saved as a shard of its own before the next is drawn: host
memory holds one layer. No dense twin (it would be the size of the bf16 model). The folder is what
``tiny.py`` writes otherwise (configs in exllamav3's form, tokenizer, chat template, processor configs,
tensor_storage, the MTP head in the last shard),
plus ``model.safetensors.index.json`` as sharded checkpoints have it; it is written into a temporary
sibling and renamed into place.

Shapes, from the published configs (transformers' Qwen3_5(Moe)TextConfig docstrings and defaults,
and the Qwen3.5 model cards):
- ``qwen3.6-27b-full``: Qwen3.6-27B, 64 layers (16 x [GDN, GDN, GDN, attention]), hidden 5120,
  intermediate 17408, 24 / 4 heads of 256, GDN 16 key / 48 value heads of 128, vocab 248320;
  3 bits with a 6-bit head, as the original deployment ran it (3.08 bpw).
- ``qwen3.5-9b-full``: Qwen3.5-9B, 32 layers (8 x [3 GDN, attention]), hidden 4096, intermediate
  12288, 16 / 4 heads of 256, GDN 16 key / 32 value heads of 128, vocab 248320; 6 bits, 6-bit head.
- ``qwen3.6-35b-a3b-full``: Qwen3.5/3.6-35B-A3B, 40 layers (10 x [3 GDN, attention]), hidden 2048,
  16 / 2 heads of 256, GDN 16 key / 32 value heads of 128, 256 routed experts of 512 (8 active) and
  a shared expert of 512, vocab 248320; 4 bits, 6-bit head, experts in mcg.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from . import codec, mtpaccept
from .tiny import progress, write_staged
from .tinyfiles import folder_files, write_configs
from .tinyspec import (
    ATTENTION_TARGETS,
    LORA_TARGETS,
    QWEN36_35B_A3B_LAYER,
    TinySpec,
    _check,
    hf_config,
    layer_projections,
    mtp_projections,
)
from .tinystate import (
    FUSED_EXPERTS_ADAPTER,
    Draw,
    _global_state,
    _layer_state,
    _write_adapter,
    add_leaf_entries,
    exl3_module_lists,
    exl3_storage_entry,
    mtp_state,
)

_FOUR = ("linear_attention",) * 3 + ("full_attention",)
FULL_PRESETS: dict[str, dict] = {
    "qwen3.6-27b-full": dict(
        hidden=5120,
        intermediate=17408,
        vocab=248320,
        heads=24,
        kv_heads=4,
        head_dim=256,
        gdn_key_heads=16,
        gdn_value_heads=48,
        gdn_head_dim=128,
        max_position=262144,
        layer_types=_FOUR * 16,
        bits=3,
        head_bits=6,
    ),
    "qwen3.5-9b-full": dict(
        hidden=4096,
        intermediate=12288,
        vocab=248320,
        heads=16,
        kv_heads=4,
        head_dim=256,
        gdn_key_heads=16,
        gdn_value_heads=32,
        gdn_head_dim=128,
        max_position=262144,
        layer_types=_FOUR * 8,
        bits=6,
        head_bits=6,
    ),
    "qwen3.6-35b-a3b-full": dict(
        **QWEN36_35B_A3B_LAYER,
        vocab=248320,
        max_position=262144,
        layer_types=_FOUR * 10,
        experts=256,
        bits=4,
        head_bits=6,
    ),
}


def full_spec(name: str, **overrides) -> TinySpec:
    if name not in FULL_PRESETS:
        raise ValueError(f"unknown full-depth preset {name!r}; choose one of {sorted(FULL_PRESETS)}")
    return TinySpec(**{**FULL_PRESETS[name], "adapters": ("lora-a",), **overrides})


def random_exl3(fin: int, fout: int, bits: int, codebook: str, gen, torch, device) -> dict:
    """An EXL3 linear from random bits: any trellis is valid; ``suh``/``svh`` are random signs scaled
    as ``codec.random_exl3_linear`` scales them (weights of standard deviation ~0.02)."""
    trellis = torch.randint(
        -(1 << 15), 1 << 15, (fin // 16, fout // 16, 16 * bits), dtype=torch.int16, device=device, generator=gen
    )
    root = codec.sign_scale(codebook)

    def signs(n):
        return ((torch.randint(0, 2, (n,), device=device, generator=gen) * 2 - 1) * root).to(torch.float16)

    return {"trellis": trellis, "suh": signs(fin), "svh": signs(fout), **codec.marker_tensors(codebook)}


def write_full(out_dir: str | os.PathLike, spec: TinySpec, device: str = "cuda") -> dict:
    """Write the EXL3 folder ``out_dir/exl3`` (sharded: globals, one shard per decoder layer, the head)
    and one LoRA adapter; returns the manifest."""
    import torch
    from safetensors.torch import save_file

    _check(spec)
    return write_staged(out_dir, lambda tmp: _write_full(tmp, spec, torch, save_file, device))


def _write_full(tmp: Path, spec: TinySpec, torch, save_file, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    # routed experts are drawn on the CPU: ~3,000 small tensors a layer at the 35B-A3B shape, which
    # would be as many GPU draws and copies back (docs/make-tiny.md: the timings)
    expert_gen = torch.Generator().manual_seed(spec.seed + 2)
    draw = Draw(gen, torch, device)
    cfg = hf_config(spec)
    folder = tmp / "exl3"
    folder_files(folder, spec)
    layers = len(spec.layer_types)
    names = [f"model-{i + 1:05d}-of-{layers + 3:05d}.safetensors" for i in range(layers + 3)]
    storage, weight_map, total = {}, {}, 0

    def save(state: dict, index: int) -> None:
        nonlocal total
        state = {k: v.contiguous().cpu() for k, v in state.items()}
        add_leaf_entries(storage, state)
        save_file(state, str(folder / names[index]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, names[index]))
        total += sum(t.numel() * t.element_size() for t in state.values())

    known = spec.mtp_acceptance is not None  # a head at a chosen acceptance (checkpoint/mtpaccept.py)
    glob = _global_state(spec, cfg, draw)
    if known:  # its float16 head is written with the MTP head's shard, once mtp.fc is drawn
        glob.pop("lm_head.weight")
        glob["model.language_model.embed_tokens.weight"] = emb = mtpaccept.embedding(spec, torch)
        glob["model.language_model.norm.weight"] = torch.zeros(spec.hidden, dtype=getattr(torch, spec.dtype))
    save(glob, 0)
    del glob
    index = 0
    for n, kind in progress(list(enumerate(spec.layer_types)), "layers"):
        state = _layer_state(spec, n, kind, draw)
        for suffix, fin, fout in layer_projections(spec, kind):
            prefix = f"model.language_model.layers.{n}.{suffix}"
            if ".experts." in suffix:
                cb, on, at = spec.expert_codebook, expert_gen, "cpu"
            else:
                cb, on, at, index = spec.codebook_for(index), gen, device, index + 1
            state.update({f"{prefix}.{k}": v for k, v in random_exl3(fin, fout, spec.bits, cb, on, torch, at).items()})
            if known and mtpaccept.is_out_projection(prefix):
                state[f"{prefix}.svh"] = mtpaccept.quiet(state[f"{prefix}.svh"], torch)
            storage[prefix] = exl3_storage_entry(state, prefix, spec.bits, cb)
        save(state, n + 1)
    head = {}
    if spec.head_bits is not None:
        head = {
            f"lm_head.{k}": v
            for k, v in random_exl3(spec.hidden, spec.vocab, spec.head_bits, "mcg", gen, torch, device).items()
        }
        storage["lm_head"] = exl3_storage_entry(head, "lm_head", spec.head_bits, "mcg")
    if not known:
        save(head, layers + 1)
    # the MTP head in a shard of its own, as exllamav3 quantizes it (tinyspec.mtp_projections)
    state = mtp_state(spec, draw)
    for prefix, fin, fout in mtp_projections(spec):
        cb, on, at = (spec.expert_codebook, expert_gen, "cpu") if ".experts." in prefix else ("mcg", gen, device)
        state.update({f"{prefix}.{k}": v for k, v in random_exl3(fin, fout, spec.mtp_bits, cb, on, torch, at).items()})
        if known and mtpaccept.is_out_projection(prefix):
            state[f"{prefix}.svh"] = mtpaccept.quiet(state[f"{prefix}.svh"], torch)
        storage[prefix] = exl3_storage_entry(state, prefix, spec.mtp_bits, cb)
    shaped = None
    if known:
        state.update(mtpaccept.mtp_norms(spec, torch))
        # y = x @ W; the embedding comes first in the head's concat
        fc_top = codec.dense_weight(codec.linear_tensors(state, "mtp.fc"))[: spec.hidden]
        save({"lm_head.weight": mtpaccept.head(spec, emb, fc_top, torch, torch.float16)}, layers + 1)
        shaped = mtpaccept.manifest_entry(spec)
    save(state, layers + 2)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    write_configs(folder, spec, cfg, storage)
    # adapters for the LoRA runs: lora-a over the attention and GDN projections; lora-mlp over those and the MLP
    # (a MoE's shared expert); a MoE's lora-experts-3d over those and its routed experts
    adapter = dataclasses.replace(spec, lora_targets=ATTENTION_TARGETS)
    keys = _write_adapter(tmp / "lora-a", adapter, torch, save_file, torch.Generator().manual_seed(spec.seed + 1))
    mlp = dataclasses.replace(spec, lora_targets=LORA_TARGETS)
    mlp_keys = _write_adapter(tmp / "lora-mlp", mlp, torch, save_file, torch.Generator().manual_seed(spec.seed + 3))
    adapters = {"lora-a": keys, "lora-mlp": mlp_keys}
    if spec.experts:  # and lora-mlp's projections plus the routed experts, in PEFT's target_parameters form (P13)
        gen = torch.Generator().manual_seed(spec.seed + 4)
        adapters[FUSED_EXPERTS_ADAPTER] = _write_adapter(tmp / FUSED_EXPERTS_ADAPTER, mlp, torch, save_file, gen)
    manifest = {
        "spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in spec.__dict__.items()},
        **exl3_module_lists(storage),
        "weight_bytes": total,
        "adapters": adapters,
        **({"mtp_acceptance": shaped} if shaped else {}),
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest
