"""The tensors of a tiny checkpoint: the seeded draws of every weight, the EXL3 storage entries, the fused-expert
layout of the dense twin, and the PEFT adapters."""

from __future__ import annotations

import json
from pathlib import Path

from . import codec
from .tinyspec import ADAPTER_TARGETS, GDN_GATE_TARGETS, TinySpec, layer_projections

# the head's weight scale, float16 or EXL3 alike: an adapter's effect on the logprobs scales with it, and the
# server suite's LoRA cells need it above three tolerances whichever head the checkpoint has
HEAD_STD = 0.1


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
        state["lm_head.weight"] = rnd(spec.vocab, spec.hidden, std=HEAD_STD)
    h = v["hidden_size"]
    for block in range(v["depth"]):
        b = f"model.visual.blocks.{block}."
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


def _layer_state(spec: TinySpec, n: int, kind: str, draw: Draw, prefix: str = "model.language_model.layers.") -> dict:
    """One decoder layer's unquantized tensors (under ``prefix``: ``mtp.layers.`` for the MTP head's), in the
    dtypes exllamav3 writes them: ``keep`` (the config's dtype) for what its loaders read with ``allow_bf16``
    -- RMSNorm weights, the GDN conv1d --, float16 for the unquantized linears, bfloat16 for the GDN
    dt_bias, A_log and output norm."""
    t = draw.torch
    keep = getattr(t, spec.dtype)
    rnd = draw.randn
    conv_dim = 2 * spec.gdn_key_heads * spec.gdn_head_dim + spec.gdn_value_heads * spec.gdn_head_dim
    p = f"{prefix}{n}."
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


def mtp_state(spec: TinySpec, draw: Draw) -> dict:
    """The MTP head's unquantized tensors (exllamav3 architecture/qwen3_5_mtp.py): the two pre-fc norms, each
    MTP layer's norms (and, in a MoE model, its router and shared-expert gate), the final norm. Drawn after
    every trunk tensor, so that the trunk is the same with and without an MTP head."""
    keep = getattr(draw.torch, spec.dtype)
    if not spec.mtp_layers:
        return {}
    state = {
        f"mtp.{name}.weight": draw.randn(spec.hidden, std=0.1, dtype=keep)
        for name in ("pre_fc_norm_hidden", "pre_fc_norm_embedding")
    }
    for n in range(spec.mtp_layers):
        state.update(_layer_state(spec, n, "full_attention", draw, prefix="mtp.layers."))
    state["mtp.norm.weight"] = draw.randn(spec.hidden, std=0.1, dtype=keep)
    return state


def _base_state(spec: TinySpec, cfg: dict, gen, torch) -> dict:
    """Every unquantized tensor with the shapes of HF's Qwen3_5(Moe)ForConditionalGeneration."""
    draw = Draw(gen, torch)
    state = _global_state(spec, cfg, draw)
    for n, kind in enumerate(spec.layer_types):
        state.update(_layer_state(spec, n, kind, draw))
    return state


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


def exl3_module_lists(storage: dict) -> dict[str, list[str]]:
    """The manifest's lists of EXL3 modules: the trunk's (``exl3_modules``, which the adapters cover) and the MTP
    head's (``mtp_modules``, which aphrodite does not load), each sorted."""
    exl3 = sorted(k for k, v in storage.items() if v.get("quant_format") == "exl3")
    return {
        "exl3_modules": [k for k in exl3 if not k.startswith("mtp.")],
        "mtp_modules": [k for k in exl3 if k.startswith("mtp.")],
    }


def stored_tensor_info(state: dict, prefix: str) -> dict:
    """tensor_storage's ``stored_tensors`` for one module, in exllamav3's form (dtype as ``str(torch dtype)``)."""
    return {
        name: {"shape": list(t.shape), "n_bytes": t.numel() * t.element_size(), "dtype": str(t.dtype)}
        for name, t in sorted(state.items())
        if name.rsplit(".", 1)[0] == prefix
    }


# lora_B's standard deviation on in_proj_a / in_proj_b: the gates move few logits per unit of delta, so at the
# trunk's 0.05 a server that dropped them would still land within the server suite's tolerance (0.15); at 0.5
# they move the reference by 0.38 over the served top-5 entries of the cell's answers, more than two tolerances
# (tests/unit/test_tiny.py), which the server cell's check needs
GATE_B_STD = 0.5


FUSED_EXPERTS_ADAPTER = "lora-experts-3d"
# lora_B's scale on the routed experts: at 0.05 (the other projections') an expert adapter's expert deltas alone move
# the tiny MoE's answers by 0.41, under the 3 x 0.15 the MoE server cells require to tell them applied
EXPERT_B_STD = 0.15
# PEFT's target_parameters on transformers' fused experts, in this order: PEFT nests one ParamWrapper per parameter,
# the first innermost, so gate_up_proj's factors are saved under ``experts.base_layer`` and down_proj's under
# ``experts`` (PEFT 0.21.2's get_peft_model_state_dict on make-tiny's tiny-moe dense twin, 2026-12-06)
FUSED_EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def fused_expert_lora(spec: TinySpec, torch, gen) -> dict:
    """Every MoE layer's routed experts in PEFT's ``target_parameters`` layout (``ParamWrapper`` on a 3D parameter):
    ``lora_A`` (experts x rank, in) with expert e's rows at [e r, (e + 1) r), ``lora_B`` (out, rank x experts) with
    rank row i of expert e at column i x experts + e (PEFT's get_delta_weight: A.reshape(E, r, in),
    B.reshape(out, r, E)). gate_up_proj's out is 2 x the expert width, gate first."""
    e, r, h, i = spec.experts, spec.lora_rank, spec.hidden, spec.moe_intermediate
    out = {}
    for n in range(len(spec.layer_types)):
        key = f"base_model.model.model.language_model.layers.{n}.mlp.experts"
        for sub, fin, fout in ((".base_layer", h, 2 * i), ("", i, h)):
            out[f"{key}{sub}.lora_A.weight"] = (torch.randn(e * r, fin, generator=gen) / fin**0.5).to(torch.float16)
            out[f"{key}{sub}.lora_B.weight"] = (torch.randn(fout, r * e, generator=gen) * EXPERT_B_STD).to(
                torch.float16
            )
    return out


def _write_adapter(dest: Path, spec: TinySpec, torch, save_file, gen) -> list[str]:
    """A PEFT LoRA adapter over the EXL3 projections named in ``spec.lora_targets`` (``ADAPTER_TARGETS`` names
    the adapters that target more: ``lora-ab`` also the GDN ``in_proj_a``/``in_proj_b``). In a MoE model the
    routed experts are left out, except by the adapter named ``lora-experts`` (keys per expert: transformers'
    fused experts have no such modules, so its HF reference merges the deltas into the fused weights) and by
    ``lora-experts-3d`` (PEFT's ``target_parameters`` form on the fused experts, ``fused_expert_lora``)."""
    dest.mkdir()
    state = {}
    with_experts = dest.name == "lora-experts"
    fused_experts = dest.name == FUSED_EXPERTS_ADAPTER
    targets = ADAPTER_TARGETS.get(dest.name, spec.lora_targets)
    gates = [(f"linear_attn.{t}", spec.hidden, spec.gdn_value_heads) for t in GDN_GATE_TARGETS if t in targets]
    for n, kind in enumerate(spec.layer_types):
        for suffix, fin, fout in layer_projections(spec, kind) + (gates if kind == "linear_attention" else []):
            if suffix.split(".")[-1] not in targets or (".experts." in suffix and not with_experts):
                continue
            key = f"base_model.model.model.language_model.layers.{n}.{suffix}"
            state[key + ".lora_A.weight"] = (torch.randn(spec.lora_rank, fin, generator=gen) / fin**0.5).to(
                torch.float16
            )
            scale = GATE_B_STD if suffix.split(".")[-1] in GDN_GATE_TARGETS else 0.05
            scale = EXPERT_B_STD if ".experts." in suffix else scale
            state[key + ".lora_B.weight"] = (torch.randn(fout, spec.lora_rank, generator=gen) * scale).to(torch.float16)
    if fused_experts:
        state.update(fused_expert_lora(spec, torch, gen))
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
                "target_modules": list(targets),
                **({"target_parameters": list(FUSED_EXPERT_PARAMETERS)} if fused_experts else {}),
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
