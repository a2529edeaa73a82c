"""P12 on the GPU (0.24+): real Exl3LinearMethod layers of the 27B's shapes -- a single projection (down_proj), the
fused gate/up (aphrodite's ``exl3_gate_up`` op) and q/k/v (``exl3_qkv``) -- routed by P12 to the rebuild and to a kept
float16 weight answer like aphrodite's own path at 1 - 256 rows, eagerly and under torch.compile (fullgraph); and
P12's own measurement of down_proj picks a path that answers right."""

from __future__ import annotations

import importlib

import pytest
import torch

from helpers import exl3_linear_layer
from hybrid_exl3_fixes.checkpoint import codec
from hybrid_exl3_fixes.decisions import exl3_kernels as kernels
from hybrid_exl3_fixes.decisions import p12_mid_batch as midbatch

ROWS = (1, 16, 33, 48, 64, 100, 144, 145, 200, 256)
MODULE = "aphrodite.model_executor.layers.quantization.exl3"
LAYERS = {
    "down_proj": ("model.layers.0.mlp.down_proj", {None: (17408, 5120)}),
    "gate_up": ("model.layers.0.mlp.gate_up_proj", {0: (5120, 17408), 1: (5120, 17408)}),
    "qkv": ("model.layers.3.self_attn.qkv_proj", {"q": (5120, 12288), "k": (5120, 1024), "v": (5120, 1024)}),
}


@pytest.fixture
def p12(monkeypatch):
    exl3 = importlib.import_module(MODULE)
    if getattr(exl3, "_EXL3_AUTO_RECONSTRUCT_THRESHOLD", None) is None:
        pytest.skip("P12 routes against the 144-row threshold of aphrodite 0.24+")
    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p12_mid_batch as module

    module.reset_state()
    yield module
    module.reset_state()


def layer_and_reference(kind: str):
    exl3 = importlib.import_module(MODULE)
    prefix, shapes = LAYERS[kind]
    gen = torch.Generator().manual_seed(5)
    shards = {s: codec.random_exl3_linear(k, n, 3, "mcg", gen, device="cuda") for s, (k, n) in shapes.items()}
    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=3.0))
    layer = exl3_linear_layer(exl3, method, prefix, shards, device="cuda")
    exl3.Exl3LinearMethod._setup_mgemm_if_supported(layer)
    assert getattr(layer, "exl3_can_mgemm", False) == (kind != "down_proj")
    k = next(iter(shapes.values()))[0]
    x_all = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(6)).to(torch.float16).cuda()
    ref = {rows: method.apply(layer, x_all[:rows].contiguous()).float() for rows in ROWS}  # before any entry
    return method, layer, x_all, ref


def worst_error(fn, x_all, ref) -> float:
    errors = []
    for rows in ROWS:
        y = fn(x_all[:rows].contiguous()).float()
        errors.append(float((y - ref[rows]).norm() / ref[rows].norm()))
    return max(errors)


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("path", [midbatch.REBUILD, midbatch.KEPT])
def test_a_routed_layer_answers_like_aphrodite(p12, kind, path, monkeypatch, record):
    if path == midbatch.KEPT:
        monkeypatch.setenv(midbatch.KEEP_ENV, "all")
    method, layer, x_all, ref = layer_and_reference(kind)

    def prefer(method, layer, weight):  # a fake input: the times that make P12 pick `path` at every step
        return {rows: {midbatch.NATIVE: 100.0, path: 50.0} for rows in midbatch.ROW_STEPS}

    steps = p12.plan_layer(method, layer, prefer)
    assert steps == tuple((rows, path) for rows in midbatch.ROW_STEPS)
    assert p12.ENTRIES and all((e[1] is not None) == (path == midbatch.KEPT) for e in p12.ENTRIES.values())
    eager = worst_error(lambda x: method.apply(layer, x), x_all, ref)
    compiled_fn = torch.compile(lambda x: method.apply(layer, x), fullgraph=True, dynamic=True)
    compiled = worst_error(compiled_fn, x_all, ref)
    exl3 = importlib.import_module(MODULE)
    record(f"P12 {path}, {kind}", eager=eager, compiled=compiled, entries=len(p12.ENTRIES))
    assert exl3._EXL3_AUTO_RECONSTRUCT_THRESHOLD == 144
    assert eager < kernels.SAME and compiled < kernels.SAME, (eager, compiled)


def test_the_measured_choice_answers_right(p12, record):
    method, layer, x_all, ref = layer_and_reference("down_proj")
    steps = p12.plan_layer(method, layer)
    (picked, times) = next(iter(p12.TIMES.values()))
    error = worst_error(lambda x: method.apply(layer, x), x_all, ref)
    record("P12 measured, down_proj 17408 x 5120, 3 bits", choice=midbatch.describe(picked, times), error=error)
    assert steps == picked and set(times) == set(midbatch.ROW_STEPS)
    assert all(set(at) == {midbatch.NATIVE, midbatch.REBUILD} for at in times.values())  # no opt-in: no kept
    assert error < kernels.SAME, error
