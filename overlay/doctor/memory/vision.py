"""The vision encoder's share of the profiling run's torch peak (arithmetic.plan's ``vision_encoder`` term).

Restated from aphrodite-engine's sources (the same in 0.20.0 - 0.24.1): before the text dummy run,
``v1/worker/gpu_model_runner.py`` ``profile_run`` runs the vision encoder once on ``items`` dummy images of the
largest size the processor allows and keeps the outputs in the encoder cache through the text dummy run
(``multimodal/encoder_budget.py``, ``v1/core/encoder_cache_manager.py`` ``compute_mm_encoder_budget``):

- tokens per image ``T``: the processor's ``longest_edge`` / (patch x merge)^2 (``qwen2_vl.py``
  ``get_image_size_with_most_features``; 16,384 for the published processor, a 4,096 x 4,096 image). The published
  video processor's largest item is 12,288 tokens (``video_tokens``), so the image is the profiled modality
  unless images are off;
- encoder budget ``max(max_num_batched_tokens, T)``, ``items = max(1, min(budget // T, max_num_seqs x
  max(1, min(image limit, max_model_len // T))))`` (the image limit: ``--limit-mm-per-prompt``, 999 unset);
- the encoder (``qwen3_vl.py`` ``Qwen3_VisionTransformer``, tensor-parallel like the text model unless
  ``--mm-encoder-tp-mode data``) sees ``n = items x T x merge^2`` patches.

Its peak, counted from the tensors alive at each step of the eager forward (an estimate, bounded in bounds.py):
the pixels, already in the model dtype (``multimodal/processing/context.py`` ``_postprocess_output`` casts every
float tensor the processor returns), ``n x C x 2`` B with ``C = channels x temporal x patch^2``; the interpolated
position embeddings kept through the
blocks, ``n x width x 2`` B; one block's largest moment, ``n x 2 B x max(3 w + 8 w/tp, 2 w + 2 f/tp)`` (attention:
the block input, its norm, qkv, the q/k copy and its rotated copy, the context and the projection; MLP: input, norm,
fc1 and its activation). The encoder outputs, ``items x T x out_hidden x (1 + deepstack mergers) x 2`` B, stay
allocated through the text run. The torch peak is then ``max(vit peak, text peak + outputs)``, so the term this
module adds beside the text pass's peak is ``max(vit peak - text peak, outputs)``.
"""

from __future__ import annotations

DEFAULT_LONGEST_EDGE = 16_777_216  # the published Qwen3.5/3.6 preprocessor_config.json size.longest_edge
DEFAULT_VIDEO_LONGEST_EDGE = 25_165_824  # video_preprocessor_config.json size.longest_edge (two frames' pixels)
DEFAULT_IMAGE_LIMIT = 999  # config/multimodal.py get_limit_per_prompt: a modality left unset


def mm_limits_plan(limits: dict | None) -> tuple[bool, int]:
    """What ``--limit-mm-per-prompt`` (its JSON object, or None when not given) means for the plan: text only (every
    modality 0, as ``--language-model-only``), and the image count per prompt."""
    limits = limits or {}
    return bool(limits) and not any(limits.values()), limits.get("image", DEFAULT_IMAGE_LIMIT)


def image_tokens(vision: dict, longest_edge: int = DEFAULT_LONGEST_EDGE) -> int:
    """Tokens of the largest image: longest_edge pixels over (patch x merge)^2."""
    return longest_edge // (vision["patch"] * vision["merge"]) ** 2


def video_tokens(vision: dict, longest_edge: int = DEFAULT_VIDEO_LONGEST_EDGE) -> int:
    """Tokens of the largest video item (qwen3_vl.py get_max_video_tokens: two frames at longest_edge / temporal
    pixels, one temporal patch), the profiled item when images are off (``--limit-mm-per-prompt`` image 0)."""
    return longest_edge // vision["temporal"] // (vision["patch"] * vision["merge"]) ** 2


def profiled_items(tokens: int, eng, limit: int | None = None) -> int:
    """How many items of ``tokens`` each the profiling run encodes at once (encoder_budget.py _get_max_items);
    ``limit``: the modality's per-prompt limit (default: the image limit)."""
    budget = max(eng.max_num_batched_tokens, tokens)
    limit = eng.image_limit if limit is None else limit
    per_prompt = max(1, min(limit, eng.max_model_len // tokens))
    return max(1, min(budget // tokens, eng.max_num_seqs * per_prompt))


def vision_encoder(vision: dict, eng, text_peak: int) -> tuple[int, str, dict]:
    """(bytes beside the text pass's peak, formula, the parts) for the profiling run's vision encoder."""
    if eng.image_limit:
        tokens = eng.image_tokens or image_tokens(vision)
        items = profiled_items(tokens, eng)
    else:  # images off, video on (all off is text-only: no term)
        tokens = video_tokens(vision)
        items = profiled_items(tokens, eng, DEFAULT_IMAGE_LIMIT)
    n = items * tokens * vision["merge"] ** 2
    w, f, tp = vision["width"], vision["intermediate"], eng.tp
    c = vision["channels"] * vision["temporal"] * vision["patch"] ** 2
    pixels = n * c * 2
    positions = n * w * 2
    block = n * 2 * max(3 * w + 8 * w // tp, 2 * w + 2 * f // tp)
    vit = pixels + positions + block
    outputs = items * tokens * vision["out_hidden"] * (1 + vision.get("deepstack", 0)) * 2
    extra = max(vit - text_peak, outputs)
    parts = {"items": items, "tokens_per_image": tokens, "patches": n, "vit_peak": vit, "outputs": outputs}
    gib = 1 << 30
    formula = (
        f"{items} image(s) x {tokens:,} tokens = {n:,} patches: encoder peak {vit / gib:.2f} GiB (pixels "
        f"{pixels / gib:.2f} + positions {positions / gib:.2f} + one block {block / gib:.2f}) against the text pass's "
        f"{text_peak / gib:.2f} GiB; outputs kept {outputs / gib:.3f} GiB: max(encoder - text, outputs)"
    )
    return extra, formula, parts
