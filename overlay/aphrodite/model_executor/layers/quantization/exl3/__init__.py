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
- P16 ``p16_moe_small_batch`` EXL3 routed experts at 2 - 32 tokens: one GEMM per projection, not a loop over tokens

What they share is in hybrid_exl3_fixes.shared: no patch module imports another.
"""
