"""The memory plan: KV and GDN state per token and sequence, and the engine's own arithmetic (arithmetic.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..base import GIB, Report
from ..files import image_tokens
from ..shape import Shape
from . import arithmetic
from .arithmetic import Engine, is_mtp


def kv_bytes_per_token(shape: Shape, kv_dtype: str, dtype: str = "bfloat16") -> tuple[int, str]:
    """KV bytes per token over the full-attention layers; ``auto`` keeps the cache in the activations' ``dtype``."""
    full = shape.full_layers
    heads, dim = shape.kv_heads or 0, shape.head_dim or 0
    width = arithmetic.kv_value_bytes(kv_dtype, dtype)
    return full * heads * dim * 2 * width, f"{full} full layers x {heads} KV heads x {dim} x 2 (K,V) x {width} B"


def state_bytes_per_sequence(shape: Shape, dtype: str = "bfloat16") -> tuple[int, int, str]:
    """The GDN state of one sequence, over every linear-attention layer (arithmetic.gdn_state_bytes per layer)."""
    linear = shape.linear_layers
    if not linear or shape.gdn is None:
        return 0, 0, "no linear-attention layers"
    g = shape.gdn
    recurrent, conv, ssm, width = arithmetic.gdn_state_bytes(shape, dtype)
    source = shape.ssm_source if shape.ssm_dtype else dtype
    return (
        linear * recurrent,
        linear * conv,
        (
            f"{linear} linear layers x ({g['value_heads']} value heads x {g['key_dim']} x {g['value_dim']} x {ssm} B "
            f"recurrent ({source}) + {2 * g['key_heads'] * g['key_dim'] + g['value_heads'] * g['value_dim']} conv "
            f"channels x {g['kernel'] - 1} x {width} B)"
        ),
    )


def uncounted_weights(report: Report, weights: int) -> str:
    """Why the weights term is short of what the engine loads ('' when every shard was read): no weights at all, or
    shards whose headers could not be read (each a BLOCK ``weights`` finding of files.read_weights)."""
    unreadable = sum(f.check == "weights" and f.level == "BLOCK" for f in report.findings)
    if unreadable:
        return f"{unreadable} shard{'s' if unreadable > 1 else ''} unreadable, above"
    return "no safetensors weights were read" if weights == 0 else ""


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
    mtp_weights = sum(t["bytes"] for n, t in tensors.items() if is_mtp(n))
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
        "mtp_weight_bytes": mtp_weights,
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
    engine = arithmetic.plan(shape, tensors, replace(eng, image_tokens=img_tokens), exl3=bool(exl3_weights))
    cap = engine["capacity"]
    pool = engine["available_kv_bytes"]
    u = engine["uncertainty"]
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
            # the smallest --kv-cache-memory-bytes whose blocks cover --max-num-seqs (CUDA graphs: see the check below)
            "min_kv_cache_memory_for_graphs": eng.max_num_seqs
            * engine["layout"]["page_bytes"]
            * engine["layout"]["group_size"],
            "replicas": max(1, gpus // eng.tp),
            "pool_formula": "requested - " + " - ".join(k for k in engine["terms"] if k != "requested"),
            "concurrency_formula": cap["formula"],
            "uncertainty": u,
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
        # one Mamba cache block, checked after the profiling run ("max_num_seqs (N) exceeds available Mamba cache
        # blocks (M)", M the plan's block count: docs/upstream/mamba-blocks-check-after-profiling.md)
        report.add(
            "BLOCK",
            "memory",
            f"the KV pool of {pool / GIB:.2f} GiB holds {cap['blocks']:,} cache blocks and --max-num-seqs is "
            f"{eng.max_num_seqs:,}: with CUDA graphs each decode sequence needs one Mamba cache block, so the "
            f'engine stops after its profiling run ("max_num_seqs ({eng.max_num_seqs}) exceeds available Mamba '
            f'cache blocks ({cap["blocks"]})"); pass --max-num-seqs {cap["blocks"]} or less, give it more memory, '
            "or use --enforce-eager",
        )
    elif uncounted := uncounted_weights(report, weights):
        report.add(
            "WARN",
            "memory",
            f"the plan counts {weights / GIB:.3f} GiB of weights ({uncounted}): the engine's KV pool will be smaller "
            f"than the {pool / GIB:.2f} GiB and {cap['kv_cache_tokens']:,} tokens below; fix the weights and run "
            "doctor again",
        )
    else:
        report.add(
            "OK",
            "memory",
            f"KV pool {pool / GIB:.2f} GiB per GPU ({u['pool_gib'][0]:.2f}-{u['pool_gib'][1]:.2f} within the terms' "
            f"bounds): {cap['kv_cache_tokens']:,} tokens, concurrency {cap['max_concurrency']:.2f}x at {context:,} "
            f"tokens ({u['max_concurrency'][0]:.2f}-{u['max_concurrency'][1]:.2f}x); after the first start pin the "
            "engine's own figure with --kv-cache-memory-bytes (it skips profiling and survives other processes' "
            "memory)",
        )
    return plan
