"""P8 on the GPU (0.20 - 0.23): a real Exl3LinearMethod layer of the 27B's down_proj shape, planned by P8's own
measurement, answers like aphrodite's reconstruct path at every row count, eagerly and under torch.compile
(fullgraph) -- the compiled case is what stopped run 24's first P8 engine, when the chosen-launch op was registered
inside Dynamo's trace."""

from __future__ import annotations

import pytest
import torch

from helpers import exl3_linear_layer
from hybrid_exl3_fixes.checkpoint import codec
from hybrid_exl3_fixes.decisions import exl3_kernels as kernels
from hybrid_exl3_fixes.decisions import p8_kernel_choice as choice

ROWS = (1, 2, 8, 9, 16, 17, 31, 32, 33)


def layer_and_reference():
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    tensors = codec.random_exl3_linear(17408, 5120, 3, "mcg", torch.Generator().manual_seed(3), device="cuda")
    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=3.0))
    layer = exl3_linear_layer(exl3, method, "model.layers.0.mlp.down_proj", {None: tensors}, device="cuda")
    x_all = torch.randn(33, 17408, generator=torch.Generator().manual_seed(4)).to(torch.float16).cuda()
    t = {k: getattr(layer, k).exl3_tensors[None] for k in ("trellis", "suh", "svh")}
    ref = torch.ops.aphrodite.exl3_linear_one(x_all, t["trellis"], t["suh"], t["svh"], True, False).float()
    return method, layer, x_all, ref


def worst_error(fn, x_all, ref) -> dict:
    out = {}
    for rows in ROWS:
        y = fn(x_all[:rows].contiguous()).float()
        out[rows] = float((y - ref[:rows]).norm() / ref[:rows].norm())
    return out


@pytest.fixture
def p8(monkeypatch):
    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p8_kernel_choice as module
    from hybrid_exl3_fixes.decisions import exl3_kernels as kernels

    verdict, _ = kernels.classify_build(kernels.installed_kernel_libraries())
    if verdict != kernels.CODEBOOK_BLIND:
        pytest.skip(f"P8 applies where the launch comes from the sample tables (0.20 - 0.23); this build: {verdict}")
    monkeypatch.setattr(module, "CHOICES", {})
    monkeypatch.setattr(module, "_CHANGED", [])
    return module


def test_a_forced_launch_compiles_and_answers_right(p8, monkeypatch, record):
    """Every row step on exllamav3's heuristic launch (a fake input: the times that make P8 pick it), the op
    registered afresh by the plan, then the layer eagerly and in a fullgraph torch.compile."""
    monkeypatch.setattr(p8, "_CHOSEN_OP", None)
    method, layer, x_all, ref = layer_and_reference()

    def prefer_heuristic(trellis, suh, svh, codebook, launches):
        return {rows: {(choice.NATIVE, 0): 100.0, launches[0]: 50.0} for rows in choice.ROW_STEPS}

    routed = p8.plan_layer(method, layer, prefer_heuristic)
    launch = kernels.forced_launch("hopper", 17408, 5120, 3, torch.cuda.get_device_properties(0).multi_processor_count)
    assert routed == {None: tuple((rows, *launch) for rows in choice.ROW_STEPS)}
    eager = worst_error(lambda x: method.apply(layer, x), x_all, ref)
    compiled_fn = torch.compile(lambda x: method.apply(layer, x), fullgraph=True, dynamic=True)
    compiled = worst_error(compiled_fn, x_all, ref)
    record("P8 forced launch, 17408 x 5120, 3 bits", eager=max(eager.values()), compiled=max(compiled.values()))
    assert max(eager.values()) < kernels.SAME and max(compiled.values()) < kernels.SAME, (eager, compiled)


def test_the_measured_choice_answers_right(p8, record):
    method, layer, x_all, ref = layer_and_reference()
    routed = p8.plan_layer(method, layer)
    (picked, times) = next(iter(p8.CHOICES.values()))
    errors = worst_error(lambda x: method.apply(layer, x), x_all, ref)
    record(
        "P8 measured choice, 17408 x 5120, 3 bits",
        choice=choice.describe(picked, times),
        routed=bool(routed),
        max_rel_error=max(errors.values()),
    )
    assert set(times) == set(choice.ROW_STEPS) and all((choice.NATIVE, 0) in at for at in times.values())
    assert max(errors.values()) < kernels.SAME, errors
