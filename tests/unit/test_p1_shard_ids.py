"""P1 (overlay/aphrodite/model_executor/layers/quantization/exl3/p1_shard_ids.py) against the real aphrodite-engine
modules (CPU): on 0.20.0/0.21.0 the unpatched code fails with the upstream error and the overlay removes it; the
releases that have the fix keep their own (test_registry.py)."""

from __future__ import annotations

import pytest
import torch

from helpers import exl3_param, needs_aphrodite, needs_buggy

pytestmark = needs_aphrodite

GDN_PREFIX = "language_model.model.layers.0.linear_attn.in_proj_qkv"
# The error 0.21.0 raised on an H200 at load (docs/gpu-runs/2026-11-30-run1), for the shard ids [0, 1, 2].
BUG1_MESSAGE = (
    f"Missing EXL3 tensors for {GDN_PREFIX}: suh[0], suh[1], suh[2], svh[0], svh[1], svh[2], "
    "trellis[0], trellis[1], trellis[2]"
)


def gdn_in_proj_qkv(exl3, method):
    """A LoRA-path GDN in_proj_qkv as create_weights + qwen3_5.load_weights leave it (TP=1).

    create_weights itself refuses to run without CUDA, so its bookkeeping is replayed here with
    the method's own _shard_ids_for_layer; the tensors are loaded through the real weight loader
    with the shard id qwen3_5.py uses under enable_lora: (0, 1, 2).
    """
    layer = torch.nn.Module()
    layer.prefix = GDN_PREFIX
    sizes = [256, 256, 512]  # key_dim, key_dim, value_dim
    layer.exl3_tp_rank, layer.exl3_tp_size = 0, 1
    layer.exl3_parallel_mode = "column"
    layer.input_size_per_partition = 256
    layer.exl3_shard_ids = method._shard_ids_for_layer(layer, sizes)
    for name in ("suh", "svh", "trellis", "mcg", "mul1"):
        layer.register_parameter(name, exl3_param(exl3))
    shapes = {"suh": (256,), "svh": (1024,), "trellis": (16, 64, 64)}
    for name, shape in shapes.items():
        exl3._exl3_weight_loader(getattr(layer, name), torch.zeros(shape), (0, 1, 2))
    return layer


@needs_buggy
def test_p1_unpatched_fails_with_upstream_error(overlay):
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0))
    layer = gdn_in_proj_qkv(exl3, method)
    assert layer.exl3_shard_ids == [0, 1, 2]
    with pytest.raises(ValueError) as err:
        method.process_weights_after_loading(layer)
    assert str(err.value) == BUG1_MESSAGE


@needs_buggy
def test_p1_patched_loads_the_fused_shard(overlay):
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    results = {r.patch.id: r for r in overlay.apply_all()}
    assert results["P1"].status.value == "APPLIED"
    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0))
    layer = gdn_in_proj_qkv(exl3, method)
    assert layer.exl3_shard_ids == [(0, 1, 2)]
    # Past the missing-tensor check; without CUDA the next step (moving shards to the current
    # CUDA device) is the first thing that may fail, and it is not bug 1.
    try:
        method.process_weights_after_loading(layer)
    except (AssertionError, RuntimeError) as exc:
        assert not torch.cuda.is_available() and "Missing EXL3 tensors" not in str(exc)
    # Other projections keep their upstream answers.
    for prefix, sizes, expected in [
        ("model.layers.3.self_attn.qkv_proj", [512, 256, 256], ["q", "k", "v"]),
        ("model.layers.0.mlp.gate_up_proj", [512, 512], [0, 1]),
        ("model.layers.0.linear_attn.in_proj_qkvz", [256, 256, 512, 512], [(0, 1, 2), 3]),
        ("model.layers.0.linear_attn.in_proj_qkv", [1024], [None]),
        ("model.layers.0.linear_attn.out_proj", [256, 256], [0, 1]),
    ]:
        layer = torch.nn.Module()
        layer.prefix = prefix
        assert method._shard_ids_for_layer(layer, sizes) == expected, prefix


@needs_buggy
def test_p1_patches_the_class_so_existing_instances_see_it(overlay):
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    before = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0))  # made before the plugin ran
    overlay.apply_all()
    layer = torch.nn.Module()
    layer.prefix = GDN_PREFIX
    assert before._shard_ids_for_layer(layer, [256, 256, 512]) == [(0, 1, 2)]
    assert isinstance(vars(exl3.Exl3LinearMethod)["_shard_ids_for_layer"], staticmethod)
