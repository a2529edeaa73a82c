"""Patches to aphrodite/model_executor/layers/quantization/exl3.py, one module each; each module's docstring holds
its Why / How / Probe / Upstream / Retire when, and cites its docs/upstream/ page.

- P1  ``p1_shard_ids``     the GatedDeltaNet ``in_proj_qkv`` shard ids with LoRA on (0.20 - 0.21)
- P3  ``p3_gemm_cache``    mixed EXL3 codebooks in one process at <= 32 rows (0.20 - 0.23)
- P8  ``p8_kernel_choice`` the <= 32-row EXL3 GEMM's launch, measured per layer at load (0.20 - 0.23)
- P12 ``p12_mid_batch``    16 - 256 EXL3 rows: the tiled GEMM, the rebuild or a kept weight, measured (0.24+)
- P4  ``p4_fp16_cat``      a fused EXL3 projection in float16, compiled
- P7  ``p7_moe_graph``     EXL3 routed experts over the fused kernel's capacity in a CUDA graph
- P9  ``p9_moe_padding``   EXL3 routed experts and the padding rows' expert id -1 (0.23+)
- P10 ``p10_moe_context``  the fused MoE kernel's device context before CUDA-graph capture (0.24+)
- P13 ``p13_moe_expert_lora`` LoRA on EXL3 routed experts: a LoRA-capable modular kernel (0.21+, an opt-in)

``common`` holds what they share.
"""

from __future__ import annotations

from .p1_shard_ids import PATCH
from .p3_gemm_cache import PATCH_P3
from .p4_fp16_cat import PATCH_P4
from .p7_moe_graph import PATCH_P7
from .p8_kernel_choice import PATCH_P8
from .p9_moe_padding import PATCH_P9
from .p10_moe_context import PATCH_P10
from .p12_mid_batch import PATCH_P12
from .p13_moe_expert_lora import PATCH_P13

__all__ = ["PATCH", "PATCH_P3", "PATCH_P4", "PATCH_P7", "PATCH_P8", "PATCH_P9", "PATCH_P10", "PATCH_P12", "PATCH_P13"]
