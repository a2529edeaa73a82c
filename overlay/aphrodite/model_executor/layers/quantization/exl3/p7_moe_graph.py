"""P7: EXL3 routed experts in a CUDA graph: no expert may get more tokens than the fused kernel takes.

Target: ``aphrodite/model_executor/layers/quantization/exl3.py``.

Why:     ``Exl3MoEMethod.apply`` sends a batch of more than ``exl3_small_batch_threshold`` tokens to
         ``ops.exl3_moe``, whose kernel skips every expert that received more tokens than its per-expert
         capacity (``if (token_count > max_tokens_per_expert) continue;`` in
         csrc/quantization/exl3/exllamav3_ext/quant/exl3_moe_kernel.cuh, v0.21.0; 128 tokens,
         ``_EXL3_MOE_MAX_TOKENS_PER_EXPERT``; 0.24 adds 32 and 1 for SM110). Outside a graph the Python
         fallback after the kernel computes those experts one by one; while a CUDA graph is captured
         ``apply`` returns straight after the kernel (``if torch.cuda.is_current_stream_capturing():
         return``), so every replay of that graph leaves out the contribution of any expert that gets
         more than 128 of the batch's tokens, silently. The default compiled mode captures piecewise
         graphs for batches up to 512 tokens (prefill chunks included), so a prompt batch of 129-512
         tokens with a popular expert is answered with wrong numbers: one request alone is right, a busy
         batch is not (measurements: docs/upstream/exl3-moe-graph-expert-capacity.md). Present in 0.20.0 - 0.24.1.
How:     While a graph is being captured and the batch has more rows than can be safe (a token
         picks each expert at most once, so a chunk of at most ``capacity`` rows never overflows), run
         the original ``apply`` on consecutive chunks of the largest safe size and write their outputs
         into one tensor: the captured graph then holds one exact kernel call per chunk. Eager calls
         and batches that cannot overflow go to the original unchanged.
Probe:   the live ``apply`` (its source, read with ``inspect``) returns from a branch that tests
         ``is_current_stream_capturing`` after calling ``exl3_moe`` (the fallback is skipped in graphs),
         and has no such branch ahead of the kernel (where patches/0007 chunks the batch).
Upstream: not reported yet; the upstream-ready diff is patches/0007-exl3-moe-graph-expert-capacity.patch.
Retire when: an aphrodite release runs the overflow experts (or chunks the batch) under capture and is
         the oldest supported one.
"""

from __future__ import annotations

import types
from typing import Any

from hybrid_exl3_fixes.registry import (
    MARKER,
    Live,
    NotApplicable,
    Patch,
    tag,
)
from hybrid_exl3_fixes.shared import MODULE, MOE_APPLY, source_tree


def returns_when_capturing(function) -> bool:
    """True when ``function`` calls ``exl3_moe`` and then returns from a branch whose test is
    ``torch.cuda.is_current_stream_capturing()`` or a name assigned from it (0.24's ``capturing``)."""
    import ast

    tree = source_tree(function, "Exl3MoEMethod.apply")

    def calls_capturing(node) -> bool:
        return any(
            isinstance(n, ast.Call)
            and getattr(n.func, "attr", getattr(n.func, "id", "")) == "is_current_stream_capturing"
            for n in ast.walk(node)
        )

    names = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and calls_capturing(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    kernel_line = min(
        (
            n.lineno
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and n.attr == "exl3_moe"
            and isinstance(getattr(n, "ctx", None), ast.Load)
            and n.value is not None
            and getattr(n.value, "id", "") == "ops"
        ),
        default=None,
    )
    if kernel_line is None:
        raise NotApplicable("Exl3MoEMethod.apply does not call ops.exl3_moe here")
    returns = {"before": False, "after": False}  # a capture branch that returns, before / after the kernel
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        tests_capture = calls_capturing(node.test) or any(
            isinstance(n, ast.Name) and n.id in names for n in ast.walk(node.test)
        )
        if tests_capture and any(isinstance(n, ast.Return) for b in node.body for n in ast.walk(b)):
            returns["before" if node.lineno < kernel_line else "after"] = True
    # a capture branch ahead of the kernel (patches/0007 chunks the batch there) means the graph path no
    # longer ends at the kernel alone
    return returns["after"] and not returns["before"]


def probe_moe_graph_capacity(live: dict[str, Live]) -> bool:
    """True = buggy: under capture the live ``apply`` returns after the fused kernel, before the
    fallback for experts the kernel skipped. Once P7 is in place (its wrapper's source, which
    ``inspect`` reaches through ``__wrapped__``, is still the original's) the question is whether the
    wrapper's chunks are safe, at today's capacities (128; 0.24's SM110: 32, and 1 up to 32 rows)."""
    function = live[MOE_APPLY.key].function
    if getattr(function, MARKER, None) == "P7":
        layers = [
            types.SimpleNamespace(exl3_small_batch_threshold=2, exl3_moe_max_tokens_per_expert=128),
            types.SimpleNamespace(
                exl3_small_batch_threshold=4,
                exl3_moe_max_tokens_per_expert=32,
                exl3_moe_short_token_threshold=32,
                exl3_moe_short_max_tokens_per_expert=1,
            ),
        ]
        return not all(
            sum(sizes) == rows and all(safe_rows(layer, n) for n in sizes)
            for layer in layers
            for rows in (3, 33, 129, 200, 512)
            for sizes in [chunk_rows(layer, rows)]
        )
    return returns_when_capturing(function)


def expert_capacity(layer: Any, rows: int) -> int:
    """How many tokens one expert may receive in a batch of ``rows`` before the fused kernel skips it."""
    import importlib

    default = getattr(importlib.import_module(MODULE), "_EXL3_MOE_MAX_TOKENS_PER_EXPERT", 128)
    capacity = getattr(layer, "exl3_moe_max_tokens_per_expert", default)  # 0.24+: per device
    if rows <= getattr(layer, "exl3_moe_short_token_threshold", 0):
        capacity = getattr(layer, "exl3_moe_short_max_tokens_per_expert", capacity)
    return capacity


def safe_rows(layer: Any, rows: int) -> bool:
    """A batch of ``rows`` tokens cannot lose an expert: it takes a per-token path (one row, or no more
    than the small-batch threshold), or no expert can get more tokens than there are rows."""
    return rows == 1 or rows <= getattr(layer, "exl3_small_batch_threshold", 0) or rows <= expert_capacity(layer, rows)


def chunk_rows(layer: Any, rows: int) -> list[int]:
    """Consecutive chunk sizes covering ``rows``, each the largest safe size left (1 always is)."""
    sizes = []
    while rows:
        size = min(rows, max(expert_capacity(layer, rows), getattr(layer, "exl3_small_batch_threshold", 1)))
        while not safe_rows(layer, size):
            size -= 1
        sizes.append(size)
        rows -= size
    return sizes


def build_moe_graph_capacity(live: dict[str, Live]) -> dict[str, Any]:
    original = live[MOE_APPLY.key].function
    import torch

    def apply(self, layer, x, topk_weights, topk_ids, *rest, **kwargs):
        rows = x.numel() // x.shape[-1]
        if not torch.cuda.is_current_stream_capturing() or safe_rows(layer, rows):  # eager calls: one C check
            return original(self, layer, x, topk_weights, topk_ids, *rest, **kwargs)
        x_2d = x.reshape(rows, x.shape[-1])
        weights, ids = topk_weights.reshape(rows, -1), topk_ids.reshape(rows, -1)
        output = torch.empty((rows, layer.hidden_size), dtype=x.dtype, device=x.device)  # what apply returns
        start = 0
        for size in chunk_rows(layer, rows):
            end = start + size
            part = original(self, layer, x_2d[start:end], weights[start:end], ids[start:end], *rest, **kwargs)
            output[start:end] = part.reshape(size, layer.hidden_size)
            start = end
        return output.reshape(*x.shape[:-1], layer.hidden_size)

    return {MOE_APPLY.key: tag("P7", apply, original)}


PATCH = Patch(
    id="P7",
    slug="exl3-moe-graph-expert-capacity",
    title="EXL3 routed experts in a CUDA graph: chunk the batch so no expert exceeds the fused kernel's capacity",
    upstream="not reported yet (patches/0007-exl3-moe-graph-expert-capacity.patch)",
    fixed_in=None,
    retire_when="an aphrodite release computes the experts the fused kernel skips under CUDA-graph capture and is "
    "the oldest supported one",
    targets=(MOE_APPLY,),
    probe=probe_moe_graph_capacity,
    build=build_moe_graph_capacity,
    after=("P9",),  # P9 first: P7's chunks then reach P9's apply, each sanitised for its own size
    symptom="EXL3 MoE in CUDA graphs answers busy batches wrongly (an expert with more than 128 tokens dropped)",
)
