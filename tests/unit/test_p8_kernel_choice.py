"""P8 without a GPU: the decision from measured times (overlay/decisions/p8_kernel_choice.py), the registry entry
against the real wheels' kernel libraries, and the load-time plan on real Exl3LinearMethod layers (fake inputs: CPU
tensors and the times a measurement would return). The kernels and the real measurement run on the H200
(bench/exl3_kernel_choice.py, tests/gpu)."""

from __future__ import annotations

import logging

import pytest
import torch
from test_p3_gemm_cache import EXPECTED, kernel_library

from helpers import APHRODITE_VERSION, exl3_linear_layer, needs_aphrodite
from hybrid_exl3_fixes.checkpoint import codec
from hybrid_exl3_fixes.decisions import exl3_kernels as kernels
from hybrid_exl3_fixes.decisions import p3_gemm_cache as p3_plan
from hybrid_exl3_fixes.decisions import p8_kernel_choice as choice

NATIVE = (choice.NATIVE, 0)


# -- the decision ---------------------------------------------------------------------------------


def test_candidates_start_with_p3s_launch_and_all_tile_the_layer():
    found = choice.candidates("hopper", 17408, 5120, 3, 132)
    assert found[0] == kernels.forced_launch("hopper", 17408, 5120, 3, 132)
    assert len(found) == len(set(found)) >= 4
    for shape, sms in found:
        assert kernels.shape_fits(shape, 17408, 5120) and 1 <= sms <= 132
    assert (found[0][0], 66) in found  # half the SMs of the heuristic's shape
    assert choice.candidates("hopper", 256, 200, 4, 132) == []


def times_at(native, **forced):
    """times[rows][launch] with the same numbers at every row step: native and {"s/m": µs}."""
    at = {NATIVE: native, **{tuple(int(p) for p in k[1:].split("_")): v for k, v in forced.items()}}
    return {rows: dict(at) for rows in choice.ROW_STEPS}


def test_a_faster_launch_is_taken_only_past_the_margin():
    taken = choice.decide(times_at(49.3, l3_132=40.4, l2_132=45.0))
    assert taken == tuple((rows, 3, 132) for rows in choice.ROW_STEPS)
    kept = choice.decide(times_at(49.3, l3_132=48.5))  # 1.6 % faster: within the margin, native kept
    assert not choice.routes_anything(kept) and kept == tuple((rows, -1, 0) for rows in choice.ROW_STEPS)


def test_each_row_step_decides_on_its_own():
    times = times_at(77.5, l3_132=60.9)
    times[32] = {NATIVE: 120.0, (3, 132): 123.0, (4, 66): 110.0}
    times[16] = {NATIVE: 70.0, (3, 132): 69.0}
    picked = choice.decide(times)
    assert picked == ((1, 3, 132), (8, 3, 132), (16, -1, 0), (32, 4, 66))
    assert [choice.launch_for(picked, r) for r in (1, 2, 8, 9, 16, 17, 32)] == [
        (3, 132),
        (3, 132),
        (3, 132),
        NATIVE,
        NATIVE,
        (4, 66),
        (4, 66),
    ]
    assert choice.saving(times, picked) == pytest.approx({1: 16.6, 8: 16.6, 16: 0.0, 32: 10.0})
    assert choice.describe(picked, times).startswith("1 row: 3/132 60.9 us (native 77.5), 8 rows: 3/132")
    assert "16 rows: native 70.0 us" in choice.describe(picked, times)


def test_without_native_times_the_fastest_forced_launch_is_taken_and_nothing_timed_keeps_native():
    only_forced = {rows: {(3, 132): 50.0, (2, 132): 45.0} for rows in choice.ROW_STEPS}
    assert choice.decide(only_forced) == tuple((rows, 2, 132) for rows in choice.ROW_STEPS)
    assert not choice.routes_anything(choice.decide({}))


# -- the registry entry ---------------------------------------------------------------------------


@needs_aphrodite
def test_probe_and_apply_in_process(overlay, monkeypatch):
    """The release's real kernel library: the sample-table choice (0.20 - 0.23) -> APPLIED over P3's wrapper, the
    autotuner (0.24) -> UPSTREAM_FIXED with nothing replaced; undo restores what was there."""
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p3_gemm_cache as p3
    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p8_kernel_choice as p8

    version = APHRODITE_VERSION if APHRODITE_VERSION in EXPECTED else "0.21.0"
    monkeypatch.setattr(kernels, "installed_kernel_libraries", lambda: [kernel_library(version)])
    original = vars(exl3.Exl3LinearMethod)["process_weights_after_loading"]
    p3_result = overlay.REGISTRY.apply(p3.PATCH)
    result = overlay.REGISTRY.apply(p8.PATCH)
    if EXPECTED[version] == kernels.CODEBOOK_KEYED:
        assert result.status.value == "UPSTREAM_FIXED" and p3_result.status.value == "UPSTREAM_FIXED"
        assert vars(exl3.Exl3LinearMethod)["process_weights_after_loading"] is original
        return
    assert result.status.value == "APPLIED" and p3_result.status.value == "APPLIED", (result, p3_result)
    patched = vars(exl3.Exl3LinearMethod)["process_weights_after_loading"]
    assert patched.__wrapped__.__wrapped__ is original  # P8 around P3 around aphrodite's
    # applying again changes nothing; both probes see their fix in place (P3's under P8's wrapper)
    assert overlay.REGISTRY.apply(p8.PATCH) is result
    live = {p3.PROCESS_WEIGHTS.key: overlay.REGISTRY._resolve(p3.PROCESS_WEIGHTS)}
    assert not p3.probe_codebook_blind_gemm_cache(live) and not p8.probe_table_kernel_choice(live)
    overlay.undo_all()
    assert vars(exl3.Exl3LinearMethod)["process_weights_after_loading"] is original


@needs_aphrodite
def test_switched_off_by_name(overlay, monkeypatch):
    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p8_kernel_choice as p8

    monkeypatch.setenv("HYBRID_EXL3_FIXES_DISABLE", "P8")
    assert overlay.REGISTRY.apply(p8.PATCH).status.value == "DISABLED"


# -- the load-time plan ---------------------------------------------------------------------------

DEVICE = (0, "hopper", 132)


@pytest.fixture
def p8(monkeypatch):
    pytest.importorskip("aphrodite.model_executor.layers.quantization.exl3", reason="needs aphrodite")
    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p3_gemm_cache as p3
    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p8_kernel_choice as module

    monkeypatch.setattr(module, "CHOICES", {})
    monkeypatch.setattr(module, "_CHANGED", [])
    monkeypatch.setattr(p3, "PLANNER", p3_plan.Planner())
    monkeypatch.setattr(p3, "_warned", False)
    return module


def loaded(prefix, shards):
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0))
    layer = exl3_linear_layer(exl3, method, prefix, shards)
    exl3.Exl3LinearMethod._setup_mgemm_if_supported(layer)
    return method, layer


def linear(codebook="mcg", fin=512, fout=256, K=4, seed=0):
    return codec.random_exl3_linear(fin, fout, K, codebook, torch.Generator().manual_seed(seed))


class Timer:
    """A measurement's answer (fake input): the heuristic launch ``speedup`` times the native one's time."""

    def __init__(self, speedup):
        self.speedup, self.calls = speedup, []

    def __call__(self, trellis, suh, svh, codebook, launches):
        self.calls.append((tuple(trellis.shape), codebook, list(launches)))
        return {rows: {NATIVE: 50.0, launches[0]: 50.0 * self.speedup} for rows in choice.ROW_STEPS}


def test_a_slower_native_launch_is_replaced_once_per_shape(p8, caplog):
    caplog.set_level(logging.INFO, logger="aphrodite.hybrid_exl3_fixes")
    timer = Timer(0.8)
    routed = []
    for i in range(3):
        method, layer = loaded(f"model.layers.{i}.mlp.down_proj", {None: linear("mcg")})
        routed.append(p8.plan_layer(method, layer, timer, DEVICE))
        assert vars(method)["_apply_one"].__func__ is p8._chosen_apply_one
    launch = kernels.forced_launch("hopper", 512, 256, 4, 132)
    assert routed[0] == {None: tuple((rows, *launch) for rows in choice.ROW_STEPS)} and routed[1:] == routed[:2]
    assert len(timer.calls) == 1  # measured for the first layer of the shape, reused for the rest
    lines = [r.getMessage() for r in caplog.records if "P8 on cuda:0" in r.getMessage()]
    assert len(lines) == 1 and "512 -> 256 (4 bits, mcg)" in lines[0] and "(native 50.0)" in lines[0]


def test_a_native_launch_within_the_margin_is_left_alone(p8):
    method, layer = loaded("model.layers.0.mlp.down_proj", {None: linear("mcg")})
    assert p8.plan_layer(method, layer, Timer(0.99), DEVICE) == {}
    assert "_apply_one" not in vars(method) and not hasattr(layer, "hxf_exl3_chosen")


def test_codebook_and_bits_are_part_of_the_shape(p8):
    timer = Timer(0.8)
    for i, (cb, K) in enumerate([("mcg", 4), ("mul1", 4), ("mcg", 3), ("mcg", 4)]):
        method, layer = loaded(f"model.layers.{i}.mlp.down_proj", {None: linear(cb, K=K)})
        p8.plan_layer(method, layer, timer, DEVICE)
    assert [(c[0][2] // 16, c[1]) for c in timer.calls] == [(4, "mcg"), (4, "mul1"), (3, "mcg")]


def test_fused_gate_up_and_qkv_are_left_to_aphrodites_ops(p8):
    timer = Timer(0.5)
    gate_up = {0: linear("mcg", 256, 512), 1: linear("mcg", 256, 512, seed=1)}
    qkv = {"q": linear("mcg", 256, 512), "k": linear("mcg", 256, 256), "v": linear("mcg", 256, 256, seed=2)}
    for prefix, shards in (("model.layers.0.mlp.gate_up_proj", gate_up), ("model.layers.3.self_attn.qkv_proj", qkv)):
        method, layer = loaded(prefix, shards)
        assert layer.exl3_can_mgemm
        assert p8.plan_layer(method, layer, timer, DEVICE) == {} and "_apply_one" not in vars(method)
    assert timer.calls == []


def test_p3s_routes_stay_and_the_other_shards_are_chosen(p8):
    """A GDN in_proj_qkv-like layer of two shards whose first P3 routed (another codebook owns its key): P8 times
    and routes only the second; a call for the routed shard still reaches P3's path, and undo gives the method P3's
    ``_apply_one`` back."""
    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p3_gemm_cache as p3

    method, layer = loaded("model.layers.0.mlp.down_proj", {None: linear("mcg", 256, 512)})
    p3.plan_layer(method, layer, p3_plan.ProbeVerdict(True, True, "test"))  # mcg owns (256, 512, 4)
    method, layer = loaded(
        "model.layers.1.linear_attn.in_proj_ba", {0: linear("mul1", 256, 512), 1: linear("mcg", 256, 384)}
    )
    assert p3.plan_layer(method, layer, p3_plan.ProbeVerdict(True, True, "test")) and "_apply_one" in vars(method)
    p3_apply = vars(method)["_apply_one"]
    timer = Timer(0.8)
    assert list(p8.plan_layer(method, layer, timer, DEVICE)) == [1]
    assert [c[0] for c in timer.calls] == [(16, 24, 64)]
    seen = []
    p3_routed = p8._routed_apply_one  # P3's routed path, which P8 calls for the shards P3 routed (shared.py)
    try:
        p8._routed_apply_one = lambda self, layer, x, shard: seen.append(("p3", shard))
        method._apply_one(layer, torch.zeros(1, 256), 0)
    finally:
        p8._routed_apply_one = p3_routed
    assert seen == [("p3", 0)]
    p8.reset_state()
    assert vars(method)["_apply_one"] is p3_apply and not hasattr(layer, "hxf_exl3_chosen") and p8.CHOICES == {}


def test_a_chosen_shard_calls_the_chosen_op_with_its_steps(p8, monkeypatch):
    method, layer = loaded("model.layers.0.mlp.down_proj", {None: linear("mul1")})
    p8.plan_layer(method, layer, Timer(0.8), DEVICE)
    calls = []
    monkeypatch.setattr(p8, "chosen_linear", lambda: lambda *args: calls.append(args[4:]))
    method._apply_one(layer, torch.zeros(1, 512), None)
    launch = kernels.forced_launch("hopper", 512, 256, 4, 132)
    assert calls == [(False, True, list(choice.ROW_STEPS), [launch[0]] * 4, [launch[1]] * 4)]


def test_a_failing_measurement_keeps_aphrodites_path(overlay, p8, caplog, monkeypatch):
    """The wrapper P8 installs never fails a load: a measurement that raises is logged and the layer keeps its
    path (the real wrapper around a stand-in original, fake inputs only)."""
    from hybrid_exl3_fixes import shared as common

    def broken(*args):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(p8, "measure_launches", broken)
    monkeypatch.setattr(p8, "_device_facts", lambda device: DEVICE)
    wrapped = common.after_loading("P8", lambda self, layer: None, p8.plan_layer, "P8 could not measure %s", "prefix")
    caplog.set_level(logging.WARNING, logger="aphrodite.hybrid_exl3_fixes")
    method, layer = loaded("model.layers.0.mlp.down_proj", {None: linear("mcg")})
    wrapped(method, layer)
    assert "_apply_one" not in vars(method)
    assert any("P8 could not measure model.layers.0.mlp.down_proj" in r.getMessage() for r in caplog.records)
