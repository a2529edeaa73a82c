# SPDX-License-Identifier: Apache-2.0
"""A real EXL3 routed-experts layer on the GPU for the drop-in tests of tests/kernels/moe/: make-tiny's tiny-moe
experts (4 of them, 2 active, 256 wide, 4 bits, mcg), random trellises (any bit pattern is a valid trellis)."""

import inspect
from types import SimpleNamespace

import torch

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, BITS = 4, 2, 256, 256, 4  # make-tiny's tiny-moe experts


def _trellis(rows, cols, generator):
    # any bit pattern is a valid trellis: (in / 16, out / 16, 16 * bits) int16
    shape = (rows // 16, cols // 16, 16 * BITS)
    return torch.randint(-(2**15), 2**15, shape, generator=generator, dtype=torch.int32).to(torch.int16)


def _signs(n, scale, generator):
    return (torch.randint(0, 2, (n,), generator=generator) * 2 - 1).to(torch.float16) * scale


def exl3_moe_apply(experts=EXPERTS, top_k=TOP_K):
    """``apply(x, topk_weights, topk_ids)`` of ``Exl3MoEMethod`` on that layer (or one of ``experts`` experts,
    ``top_k`` active, at the same width), loaded as the engine loads it (``process_weights_after_loading``: the
    tensors move to the GPU, the fused kernel is set up). The function's ``layer`` attribute is the layer."""
    from aphrodite.model_executor.layers.fused_moe.activation import MoEActivation
    from aphrodite.model_executor.layers.quantization.exl3 import Exl3MoEMethod

    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    for prefix in ("w13", "w2"):
        for attr in ("suh", "svh", "trellis", "mcg", "mul1"):
            setattr(layer, f"{prefix}_{attr}", SimpleNamespace(exl3_tensors={}))
    for e in range(experts):
        for shard in ("w1", "w3"):
            layer.w13_trellis.exl3_tensors[(e, shard)] = _trellis(HIDDEN, INTERMEDIATE, g)
            layer.w13_suh.exl3_tensors[(e, shard)] = _signs(HIDDEN, 1.0, g)
            layer.w13_svh.exl3_tensors[(e, shard)] = _signs(INTERMEDIATE, 0.05, g)
            layer.w13_mcg.exl3_tensors[(e, shard)] = torch.zeros(1)  # mcg: the MoE kernel's codebook
        layer.w2_trellis.exl3_tensors[(e, "w2")] = _trellis(INTERMEDIATE, HIDDEN, g)
        layer.w2_suh.exl3_tensors[(e, "w2")] = _signs(INTERMEDIATE, 1.0, g)
        layer.w2_svh.exl3_tensors[(e, "w2")] = _signs(HIDDEN, 0.05, g)
        layer.w2_mcg.exl3_tensors[(e, "w2")] = torch.zeros(1)
    layer.layer_name, layer.exl3_tp_rank, layer.exl3_tp_size = "model.layers.0.mlp.experts", 0, 1
    layer.local_num_experts, layer.top_k, layer.hidden_size = experts, top_k, HIDDEN
    layer.exl3_intermediate_size_per_partition = INTERMEDIATE
    layer.activation, layer.expert_map, layer.apply_router_weight_on_input = MoEActivation.SILU, None, False
    method = object.__new__(Exl3MoEMethod)
    with torch.cuda.device(device):
        method.process_weights_after_loading(layer)
    extra = (None,) * (len(inspect.signature(Exl3MoEMethod.apply).parameters) - 5)  # shared-expert arguments

    def apply(x, w, ids):
        return method.apply(layer, x, w, ids, *extra)

    apply.layer = layer
    return apply


def routers_mark_padding() -> bool:
    """Whether this release's routers give padding rows expert id -1 (0.23.0+: ``_get_padding_mask``)."""
    try:
        from aphrodite.model_executor.layers.fused_moe.router import fused_topk_router
    except ImportError:  # 0.20, 0.21: no router package
        return False
    return hasattr(fused_topk_router, "_get_padding_mask")
