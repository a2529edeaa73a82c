"""P1: EXL3 shard ids for the GatedDeltaNet ``in_proj_qkv`` projection with LoRA on.

Target: ``aphrodite/model_executor/layers/quantization/exl3.py``.

Why:     With ``--enable-lora``, ``models/qwen3_5.py`` builds GDN ``in_proj_qkv`` as its own
         ``MergedColumnParallelLinear`` (three output partitions: q, k, v) and ``load_weights``
         loads the fused checkpoint tensor once with the tuple shard id ``(0, 1, 2)``.
         ``Exl3LinearMethod._shard_ids_for_layer`` has branches for ``qkv_proj``,
         ``gate_up_proj`` and ``in_proj_qkvz`` only, so it falls back to ``[0, 1, 2]`` and
         ``process_weights_after_loading`` fails with
         ``ValueError: Missing EXL3 tensors for ...linear_attn.in_proj_qkv: suh[0], suh[1], ...``
         (seen on an H200 with aphrodite-engine 0.21.0; present in 0.20.0 too).
How:     Replace the class attribute (a staticmethod in 0.20/0.21) with a wrapper that answers
         ``[(0, 1, 2)]`` for a multi-partition layer whose prefix ends in ``in_proj_qkv`` and
         defers to the original for everything else. The class attribute, not an instance, is
         patched: spawned engine/worker processes unpickle ``Exl3Config`` before plugins run and
         look the method up on the class.
Upstream: https://github.com/dphnAI/sonar/pull/1711, first released in aphrodite-engine 0.22.0.
Retire when: the oldest supported aphrodite-engine is 0.22.0 (the probe already reports
         UPSTREAM_FIXED there).
"""

from __future__ import annotations

import types
from typing import Any

from hybrid_exl3_fixes.registry import Drift, Live, Patch, Target, tag
from hybrid_exl3_fixes.shared import MODULE

SHARD_IDS = Target(MODULE, "Exl3LinearMethod._shard_ids_for_layer", params=("layer", "output_partition_sizes"))

GDN_PREFIX = "language_model.model.layers.0.linear_attn.in_proj_qkv"
FUSED_QKV = [(0, 1, 2)]
BUGGY_ANSWER = [0, 1, 2]


def probe_in_proj_qkv_shard_ids(live: dict[str, Live]) -> bool:
    """Ask the live method for the shard ids of a LoRA-path GDN in_proj_qkv; True = buggy."""
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    # 0.22+ made the method an instance method that consults the quant config: build a real one.
    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0, head_bits=None, tensor_storage={}))
    answer = method._shard_ids_for_layer(types.SimpleNamespace(prefix=GDN_PREFIX), [256, 256, 512])
    if list(answer) == FUSED_QKV:
        return False
    if list(answer) == BUGGY_ANSWER:
        return True
    raise Drift(f"_shard_ids_for_layer answered {answer!r} for in_proj_qkv, expected {FUSED_QKV!r} or {BUGGY_ANSWER!r}")


def build(live: dict[str, Live]) -> dict[str, Any]:
    original = live[SHARD_IDS.key].function

    def _shard_ids_for_layer(layer, output_partition_sizes):
        if len(output_partition_sizes) > 1 and getattr(layer, "prefix", "").endswith("in_proj_qkv"):
            return list(FUSED_QKV)
        return original(layer, output_partition_sizes)

    return {SHARD_IDS.key: staticmethod(tag("P1", _shard_ids_for_layer, original))}


PATCH = Patch(
    id="P1",
    slug="exl3-in-proj-qkv-shard-ids",
    title="EXL3 shard ids for GDN in_proj_qkv (LoRA path)",
    upstream="https://github.com/dphnAI/sonar/pull/1711",
    fixed_in="0.22.0",
    retire_when="the oldest supported aphrodite-engine is 0.22.0",
    targets=(SHARD_IDS,),
    probe=probe_in_proj_qkv_shard_ids,
    build=build,
    symptom="EXL3 Qwen3.5/3.6 with `--enable-lora` stops at load: `Missing EXL3 tensors for ...in_proj_qkv`",
)
