"""Tiny synthetic EXL3 Qwen3.5 hybrid checkpoints, their exact dense twins and LoRA adapters.

No weights are downloaded: every EXL3 tensor is a random (always valid) trellis, and the dense
twin holds the weights the reference codec decodes from it, so a correct EXL3 implementation
must reproduce the dense model's outputs up to fp16 arithmetic.

Layout written under ``DIR``::

    exl3/       config.json (+quantization_config), quantization_config.json (tensor_storage),
                model.safetensors, tokenizer files, chat_template.jinja, generation_config.json,
                preprocessor_config.json, video_preprocessor_config.json
                                                             -> aphrodite, quantization="exl3"
    dense/      the same model with the decoded weights (float32), same tokenizer -> HF reference
    lora-a/, lora-b/   PEFT LoRA adapters (rank 8, non-zero B) over the EXL3 projections
    lora-ab/    the same targets plus the GDN in_proj_a / in_proj_b (as megatron-swift and VeOmni
                adapters for Qwen3.5/3.6 carry them)
    manifest.json      what was written (bits, codebook per layer, seed, modules)

Which projections are EXL3 follows exllamav3's Qwen3.5 layout: GDN ``in_proj_qkv`` (q+k+v
fused), ``in_proj_z``, ``out_proj``; attention ``q/k/v/o_proj``; MLP ``gate/up/down_proj``.
``in_proj_a``, ``in_proj_b``, ``conv1d``, ``A_log``, ``dt_bias``, norms, embeddings, lm_head and
the vision tower stay unquantized (lm_head: ``head_bits`` null, since aphrodite treats
``lm_head`` as EXL3 whenever ``head_bits`` is set). ``head_bits=N`` writes the head as EXL3 (mcg), as exllamav3 does
by default (6 bits), and its dequantized weight into the dense twin; it needs a vocabulary that is a multiple of 128.

What the EXL3 folder holds follows what exllamav3 1.6.5 writes for a Qwen3.5/3.6 source model
(``conversion/compile.py``, checked against its sources in tests/unit/test_exllamav3_layout.py):
- config.json is the source model's in the published form (tinyspec.hf_config; compared field by field
  in tests/unit/test_published_config.py), with ``quantization_config`` added: its ``dtype`` stays the
  source's, ``bfloat16`` for every published Qwen3.5/3.6 model, so that is the default here
  (``dtype="float16"`` writes the checkpoints this project used before 2026-12-01);
- the MTP head (``mtp_num_hidden_layers: 1``): exllamav3 builds an ``mtp`` component from it and quantizes
  its linears at ``--mtp_bits`` (default 4; ``quantization_config.mtp_bits``), keeping its norms: so
  ``mtp.fc`` and ``mtp.layers.0.*`` are EXL3 here too (aphrodite skips ``mtp.*`` at load);
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
import sys
from pathlib import Path

from ..staging import apply_umask, staged_sibling
from . import codec, mtpaccept
from .tinyfiles import folder_files, write_configs
from .tinyspec import (
    EXL3_SUFFIXES,
    LORA_TARGETS,
    PRESETS,
    TinySpec,
    _check,
    hf_config,
    layer_projections,
    mtp_projections,
)
from .tinystate import (
    HEAD_STD,
    Draw,
    _base_state,
    _write_adapter,
    add_leaf_entries,
    exl3_module_lists,
    exl3_storage_entry,
    fuse_experts,
    mtp_state,
)

# the public names of the writer and its spec, where callers have always imported them
__all__ = [
    "EXL3_SUFFIXES",
    "LORA_TARGETS",
    "PRESETS",
    "TinySpec",
    "hf_config",
    "progress",
    "write_staged",
    "write_tiny",
]


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
    """``write(tmp)`` into a temporary sibling of ``out_dir``, then rename it into place: a failure, Ctrl-C,
    SIGTERM or SIGHUP leaves nothing. ``out_dir`` must be new or empty; what lands there has the modes the umask
    gives, and an empty folder that was there keeps its own."""
    out = Path(out_dir)
    kept_mode = None
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise FileExistsError(f"{out} exists and is not a folder; choose a new folder")
        if any(out.iterdir()):
            raise FileExistsError(f"{out} exists and is not empty; choose a new folder")
        kept_mode = out.stat().st_mode & 0o7777

    def cannot_create(exc: OSError) -> Exception:
        return FileExistsError(f"cannot create {out}: {exc.strerror or exc}; choose a folder you can write to")

    with staged_sibling(out, f".{out.name}.", cannot_create) as tmp:
        manifest = write(tmp)
        apply_umask(tmp)
        if kept_mode is not None:
            os.chmod(tmp, kept_mode)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
        return manifest


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
    # the MTP head, drawn last (the trunk is the same without it), in the EXL3 folder only: transformers
    # drops every mtp.* tensor at load (_keys_to_ignore_on_load_unexpected), so the dense twin has none
    exl3_state.update(mtp_state(spec, Draw(gen, torch)))
    for prefix, fin, fout in mtp_projections(spec):
        codebooks[prefix] = cb = spec.codebook_for(index) if ".experts." not in prefix else spec.expert_codebook
        index += ".experts." not in prefix
        tensors = codec.random_exl3_linear(fin, fout, spec.mtp_bits, cb, gen, device=device)
        exl3_state.update({f"{prefix}.{name}": tensor for name, tensor in tensors.items()})
        storage[prefix] = exl3_storage_entry(exl3_state, prefix, spec.mtp_bits, cb)

    if spec.head_bits is not None:  # drawn last (the float16 head is drawn with the embeddings)
        tensors = codec.random_exl3_linear(
            spec.hidden, spec.vocab, spec.head_bits, "mcg", gen, scale=HEAD_STD, device=device
        )
        if dense:
            dense_state["lm_head.weight"] = codec.dense_weight(tensors, spec.head_bits, device).t().contiguous().cpu()
        exl3_state.update({f"lm_head.{name}": tensor for name, tensor in tensors.items()})
        storage["lm_head"] = exl3_storage_entry(exl3_state, "lm_head", spec.head_bits, "mcg")
        codebooks["lm_head"] = "mcg"

    shaped = None
    if spec.mtp_acceptance is not None:  # after every draw: the EXL3 trellises are the same as without it
        shaped = mtpaccept.shape(spec, exl3_state, dense_state if dense else None, torch, codec)
    if dense and spec.experts:
        fuse_experts(dense_state, spec, torch)
    add_leaf_entries(storage, exl3_state)
    exl3_dir, dense_dir = tmp / "exl3", tmp / "dense"
    for d in (exl3_dir, dense_dir) if dense else (exl3_dir,):
        folder_files(d, spec)
    write_configs(exl3_dir, spec, cfg, storage)
    save_file(exl3_state, str(exl3_dir / "model.safetensors"), metadata={"format": "pt"})
    if dense:
        text = {**cfg["text_config"], "dtype": "float32"}
        (dense_dir / "config.json").write_text(json.dumps({**cfg, "dtype": "float32", "text_config": text}, indent=2))
        save_file(dense_state, str(dense_dir / "model.safetensors"), metadata={"format": "pt"})

    adapters = {}
    for a, name in enumerate(spec.adapters):
        adapters[name] = _write_adapter(
            tmp / name, spec, torch, save_file, torch.Generator().manual_seed(spec.seed * 1000 + a + 1)
        )
    manifest = {
        "spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in spec.__dict__.items()},
        "codebooks": codebooks,
        **exl3_module_lists(storage),
        "adapters": adapters,
        **({"mtp_acceptance": shaped} if shaped else {}),
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
