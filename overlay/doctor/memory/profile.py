"""The terms of doctor's memory plan that the engine's profiling run and its model runner decide (arithmetic.plan),
restated per release from aphrodite's sources; what could not be traced to a source is labelled ``measured``.

- Weights at load: a floating-point tensor loads in the model's dtype whatever it is stored in (aphrodite's default
  weight loader copies into a parameter of the model dtype; ``--dtype auto`` turns a float32 config into bfloat16,
  config/model.py ``_resolve_auto_dtype``); an EXL3 part (trellis, suh, svh, mcg, mul1) loads as stored.
- EXL3 GEMM above a row threshold reconstructs the float16 weight first (quantization/exl3.py ``_exl3_linear_one``):
  more than 32 rows, the whole weight, in 0.20.0-0.23.0; more than 144 rows
  (``_EXL3_AUTO_RECONSTRUCT_THRESHOLD``), in slices of at most 32,768 output columns
  (``_EXL3_MAX_RECONSTRUCT_SLICE_N``), in 0.24.1.
- The model runner: 0.24.1 starts Model Runner V2 for Qwen3.5 by default (config/aphrodite.py
  ``use_v2_model_runner``: the start-up log says "Using V2 Model Runner"); 0.23.0 defaults hybrid
  targets to V1. V2 allocates after the engine's start-up snapshot, so inside the profiler's "total consumed"
  (0.23+: ``mem_utils.memory_profiling``), buffers of max_num_seqs rows: the penalties' ``output_bin_counts``
  (vocab int32) and ``prompt_bin_mask`` (vocab / 32 int32), v1/worker/gpu/sample/penalties.py, and the requests'
  ``all_token_ids`` (max_model_len int32), v1/worker/gpu/states.py (docs/upstream/model-runner-v2-penalty-buffers.md).
- Measured, source not found (docs/doctor.md "0.24.1's profiling run"): on 0.24.1 the compiled engine's profiling
  peak with an EXL3 head is the whole head's float16 reconstruction (1.99 GiB on the 9B, where slices would give
  0.25 GiB), the eager engine's is the sliced one (0.44 GiB in all). The plan follows what was measured.
"""

from __future__ import annotations

GIB = 1 << 30
EXL3_PARTS = ("trellis", "suh", "svh", "mcg", "mul1")
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
STORED_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
RECONSTRUCT_FROM = (0, 24, 1)  # reconstructs above 144 rows (32 before), in slices of RECONSTRUCT_SLICE_N columns
RECONSTRUCT_SLICE_N = 32768
V2_RUNNER_FROM = (0, 24, 1)  # Model Runner V2 by default for Qwen3.5 (0.23.0: V1)


def loaded_bytes(name: str, t: dict, model_dtype_bytes: int) -> int:
    """What one checkpoint tensor takes once loaded: a floating-point tensor in the model's dtype, any other
    (an EXL3 part, an integer tensor) as stored."""
    if t.get("dtype") not in FLOAT_DTYPES or name.rsplit(".", 1)[-1] in EXL3_PARTS:
        return t["bytes"]
    return t["bytes"] // STORED_BYTES[t["dtype"]] * model_dtype_bytes


def reconstruct_rows(release: tuple) -> int:
    """The row count above which the EXL3 GEMM reconstructs its weight on ``release``."""
    return 144 if release >= RECONSTRUCT_FROM else 32


def head_reconstruct(rows: int, in_features: int, out_features: int, release: tuple, eager: bool) -> tuple[int, str]:
    """Bytes of the float16 weight an EXL3 head reconstructs for ``rows`` rows, and how."""
    if rows <= reconstruct_rows(release):
        return 0, f"{rows} rows: the EXL3 GEMM, no reconstruction"
    whole = in_features * out_features * 2
    if release < RECONSTRUCT_FROM:
        return whole, "EXL3 head reconstructed whole"
    if eager:
        return in_features * min(out_features, RECONSTRUCT_SLICE_N) * 2, (
            f"EXL3 head reconstructed in slices of {RECONSTRUCT_SLICE_N:,} columns"
        )
    return whole, "EXL3 head: the whole head's size (measured in the compiled engine, source not found)"


def activation_peak(shape, tensors: dict, eng, exl3: bool) -> tuple[int, str]:
    """Torch peak of the profiling run: the larger of the forward pass over max_num_batched_tokens and the
    sampler pass over max_num_seqs rows (which, for an EXL3 head, may reconstruct the head in fp16). Activations
    count ``eng.dtype``'s bytes a value; EXL3's own outputs and reconstructions are float16 whatever it is."""
    from .arithmetic import dtype_bytes

    w = dtype_bytes(eng.dtype)
    h, vocab, inter = shape.hidden or 0, shape.vocab or 0, shape.intermediate or 0
    if shape.moe:
        inter = max(shape.moe.get("shared_intermediate") or 0, shape.moe.get("intermediate") or 0)
    tokens, rows, release = eng.max_num_batched_tokens, eng.max_num_seqs, eng.release_version
    head_exl3 = exl3 and any(n.startswith("lm_head.") and n.endswith(".trellis") for n in tensors)
    rebuilt, how = head_reconstruct(rows, h, vocab, release, eng.eager) if head_exl3 else (0, "")
    head = rebuilt // eng.tp + rows * vocab * w // eng.tp + tokens * h * w
    # MLP activations at max_num_batched_tokens, in the model dtype: gate/up outputs and a handful of hidden-width
    # copies (residual, norm, x_had); for EXL3 also the float16 concat of the gate/up outputs and of the input
    # (apply runs one kernel per checkpoint tensor, joins them in float16 and casts back to the model dtype)
    model_part = w * (3 * inter // eng.tp + 4 * h)
    exl3_part = 2 * (inter // eng.tp + 2 * h) if exl3 else 0
    forward = tokens * (model_part + exl3_part)
    largest = 0
    if exl3 and tokens > reconstruct_rows(release):  # the largest EXL3 tensor a pass reconstructs (head aside)
        largest = max(
            (
                t["shape"][0] * t["shape"][1] * 256 * 2 // eng.tp
                for n, t in tensors.items()
                if n.endswith(".trellis") and not n.startswith("lm_head.") and len(t.get("shape", ())) == 3
            ),
            default=0,
        )
    forward += largest
    sampler = rows * vocab * 4 * 2 // eng.tp
    peak = max(head, forward, sampler)
    which = {head: "sampler pass through the head", forward: "forward pass", sampler: "sampler (fp32 logits)"}[peak]
    exl3_text = f" + 2 B x ({inter} + 2 x {h}) EXL3 float16" if exl3 else ""
    return peak, (
        f"max(head pass {head / GIB:.2f} GiB = {how + ' ' + format(rebuilt / GIB, '.2f') + ' GiB + ' if how else ''}"
        f"{rows} rows x {vocab:,} x {w} B + {tokens} x {h} x {w} B; forward {forward / GIB:.2f} GiB = {tokens} tokens "
        f"x ({w} B x (3 x {inter} + 4 x {h}){exl3_text})"
        f"{' + largest EXL3 reconstruct' if largest else ''}; sampler "
        f"{sampler / GIB:.2f} GiB): {which}"
    )


def runner_buffers(shape, eng) -> tuple[int, str]:
    """Model Runner V2's buffers of max_num_seqs rows (0.24.1), inside the profiler's total consumed; 0 before."""
    if eng.release_version < V2_RUNNER_FROM:
        return 0, "Model Runner V1: its buffers predate the calibration (inside non_torch)"
    rows, vocab = eng.max_num_seqs, shape.vocab or 0
    per_row = vocab * 4 + -(-vocab // 32) * 4 + eng.max_model_len * 4
    return rows * per_row, (
        f"{rows} rows x (penalties {vocab:,} + {-(-vocab // 32):,} int32 + token ids {eng.max_model_len:,} int32) "
        "(Model Runner V2, the sampler's and the requests' state)"
    )
