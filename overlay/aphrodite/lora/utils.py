"""P11: the LoRA logits-processor wrapper is built for an EXL3-quantized ``lm_head``.

Why:     ``from_layer_logits_processor`` passes ``lm_head.weight.dtype`` and ``lm_head.weight.device`` to
         ``LogitsProcessorWithLoRA``. An EXL3 head (``head_bits`` in the config: exllamav3 writes the head at 6 bits
         by default, so every published conversion has one) carries ``suh``/``svh``/``trellis``/``mcg``/``mul1`` and
         no ``weight``, and the LoRA manager stops the engine at start-up with ``AttributeError: 'ParallelLMHead'
         object has no attribute 'weight'``. The manager wraps ``lm_head`` whenever a model class lists it in
         ``embedding_modules``, whatever the adapter targets: Qwen3.5/3.6 do from aphrodite-engine 0.24.0
         (``Qwen3_5ForCausalLMBase``), so there ``--enable-lora`` fails for every EXL3 checkpoint with a quantized
         head, dense or MoE; 0.20.0-0.23.0 have the same function, reached there by the other models that list
         ``lm_head`` (27 model files each). Measured on an H200 with 0.24.1 (docs/upstream/lora-exl3-lm-head.md).
How:     Where the head has no ``weight`` and carries EXL3 tensors, the original is given a view of the head whose
         ``weight`` is a stride-0 tensor of the head's shape, on the device of its EXL3 tensors and in the LoRA
         dtype (the model's dtype once aphrodite resolved ``auto``): the two values the wrapper takes from it, and
         nothing it could compute logits from. The wrapper does not keep the head: its forward gets the real one
         and runs the base projection through the head's own quant method. Every other head goes to the original
         unchanged. ``lora/model_manager.py`` binds the function by name, so both are targets.
Upstream: not reported yet; the upstream-ready diff is patches/0011-lora-exl3-lm-head.patch.
Retire when: an aphrodite release builds the wrapper without reading ``lm_head.weight`` (the probe then reports
         UPSTREAM_FIXED) and is the oldest supported one.
"""

from __future__ import annotations

import inspect
from typing import Any

from hybrid_exl3_fixes.registry import Drift, Live, Patch, Target, tag
from hybrid_exl3_fixes.shared import exl3_device, exl3_placeholder, fake_exl3_layer

PARAMS = ("layer", "lm_head", "max_loras", "lora_config", "model_config")
UTILS = Target("aphrodite.lora.utils", "from_layer_logits_processor", params=PARAMS)
MANAGER = Target("aphrodite.lora.model_manager", "from_layer_logits_processor", binds=UTILS.key)


class Exl3HeadView:
    """``lm_head`` as ``from_layer_logits_processor`` reads it, with a ``weight`` that holds no memory."""

    def __init__(self, head: Any, weight: Any):
        self._head = head
        self.weight = weight

    def __getattr__(self, name: str) -> Any:
        return getattr(self._head, name)


def has_no_weight(head: Any) -> bool:
    try:
        return getattr(head, "weight", None) is None
    except Exception:  # noqa: BLE001 - a property that raises is no weight either
        return True


def weight_stand_in(head: Any, lora_config: Any) -> Any:
    """A tensor of the head's (vocab rows, hidden) shape, expanded from one zero: its dtype is the LoRA dtype
    (the model's, resolved from ``auto`` by ``LoRAConfig.verify_with_model_config``; float16, EXL3's compute
    dtype, while unresolved), its device that of the head's EXL3 tensors."""
    import torch

    dtype = getattr(lora_config, "lora_dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = torch.float16
    rows = getattr(head, "num_embeddings_per_partition", None) or getattr(head, "num_embeddings", 0)
    cols = getattr(head, "embedding_dim", 0)
    return torch.zeros((), dtype=dtype, device=exl3_device(head)).expand(rows, cols)


def build_wrapper(original):
    signature = inspect.signature(original)

    def from_layer_logits_processor(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        head = bound.arguments.get("lm_head")
        if head is not None and has_no_weight(head) and exl3_placeholder(head) is not None:
            bound.arguments["lm_head"] = Exl3HeadView(head, weight_stand_in(head, bound.arguments.get("lora_config")))
        return original(*bound.args, **bound.kwargs)

    return from_layer_logits_processor


class _Reached(Exception):
    """Raised from the probe's head once the original got past ``lm_head.weight``."""


def fake_exl3_head() -> Any:
    """An EXL3 ``lm_head`` as the LoRA manager hands it over: EXL3 placeholders, no ``weight``; the probe stops
    at its first call after the attributes (``get_sharded_to_full_mapping``), before any TP-group lookup."""
    head = fake_exl3_layer()
    head.prefix = "lm_head"
    head.embedding_dim, head.num_embeddings, head.num_embeddings_per_partition = 16, 64, 64

    def mapping():
        raise _Reached

    head.get_sharded_to_full_mapping = mapping
    return head


def probe_lm_head_weight(live: dict[str, Live]) -> bool:
    """True when the live ``from_layer_logits_processor`` (at both binding sites) stops on an EXL3 head's missing
    ``weight``; False when it gets past the head's attributes (or builds the wrapper)."""
    import torch
    from aphrodite.config.lora import LoRAConfig

    config = LoRAConfig(max_lora_rank=8, max_loras=1, lora_dtype=torch.bfloat16)
    answers = {}
    for key, item in live.items():
        try:
            item.function(torch.nn.Module(), fake_exl3_head(), 1, config, None)
            answers[key] = False
        except _Reached:
            answers[key] = False
        except AttributeError as exc:
            if "weight" not in str(exc):
                raise Drift(f"{key} on an EXL3 head: {exc}") from exc
            answers[key] = True
    if len(set(answers.values())) > 1:
        raise Drift(f"binding sites disagree about an EXL3 lm_head: {answers}")
    return next(iter(answers.values()))


def build(live: dict[str, Live]) -> dict[str, Any]:
    original = live[UTILS.key].function
    return {UTILS.key: tag("P11", build_wrapper(original), original)}


PATCH = Patch(
    id="P11",
    slug="lora-exl3-lm-head",
    title="LoRA logits-processor wrapper for an EXL3 lm_head (Qwen3.5/3.6 on 0.24+)",
    upstream="not reported yet (patches/0011-lora-exl3-lm-head.patch)",
    fixed_in=None,
    retire_when="an aphrodite release builds LogitsProcessorWithLoRA without reading lm_head.weight",
    targets=(UTILS, MANAGER),
    probe=probe_lm_head_weight,
    build=build,
    scan_stale_copies_of=(UTILS.key,),
    symptom="an EXL3 checkpoint with a quantized head and `--enable-lora` stops at start-up: `'ParallelLMHead' "
    "object has no attribute 'weight'`",
)
