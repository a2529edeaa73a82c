"""P12 without a GPU: the decision from measured times (overlay/decisions/p12_mid_batch.py), the opt-in's parsing, the
registry entry on every release, the kernels of the real EXL3 custom ops replaced and given back, and the router's paths
(fake inputs: CPU tensors and a recording stand-in for the replaced kernel). The measurement and the layers' answers run
on the H200 (tests/gpu/test_p12_mid_batch.py, bench/exl3_mid_batch.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from helpers import APHRODITE_VERSION, needs_aphrodite
from hybrid_exl3_fixes.decisions import p12_mid_batch as midbatch
from hybrid_exl3_fixes.registry import tags_of

MODULE = "aphrodite.model_executor.layers.quantization.exl3"
HAS_THRESHOLD = APHRODITE_VERSION not in (None, "0.20.0", "0.21.0", "0.22.0", "0.23.0")


# -- the decision ---------------------------------------------------------------------------------


def tiled(rows: int) -> float:
    """A tiled GEMM's time: 60 µs a 16-row tile (the shape of run 25's 27B steps)."""
    return 60.0 * -(-rows // 16)


def times(kept: bool = False) -> dict:
    out = {}
    for rows in midbatch.ROW_STEPS:
        at = {midbatch.NATIVE: tiled(rows) if rows <= 144 else 150.0, midbatch.REBUILD: 150.0}
        if kept:
            at[midbatch.KEPT] = 40.0 + rows * 0.05
        out[rows] = at
    return out


def test_the_rebuild_is_taken_where_it_beats_the_tiles():
    steps = midbatch.decide(times())
    # the rebuild (150) beats 3 tiles (180) from 48 rows; at 32 (120) the tiles win; above 144 native is the rebuild
    assert dict(steps) == {
        **{r: midbatch.NATIVE for r in (1, 8, 16, 32)},
        **{r: midbatch.REBUILD for r in (48, 64, 80, 96, 112, 128, 144)},
        192: midbatch.NATIVE,
        256: midbatch.NATIVE,
    }
    assert [midbatch.path_for(steps, r) for r in (1, 32, 33, 48, 49, 144, 145, 300)] == [
        "native",
        "native",
        "rebuild",
        "rebuild",
        "rebuild",
        "rebuild",
        "native",
        "native",
    ]
    assert midbatch.routes_anything(steps) and not midbatch.keeps(steps)
    saved = midbatch.saving(steps, times())
    assert saved[32] == 0.0 and saved[64] == pytest.approx(1 - 150 / 240)


def test_a_kept_weight_wins_every_step_it_is_faster():
    steps = midbatch.decide(times(kept=True))
    assert {path for _, path in steps} == {midbatch.KEPT} and midbatch.keeps(steps)
    assert "kept" in midbatch.describe(steps, times(kept=True))


def test_within_the_margin_or_untimed_native_stays():
    at = {r: {midbatch.NATIVE: 100.0, midbatch.REBUILD: 98.0} for r in midbatch.ROW_STEPS}  # 2 %: within 3 %
    assert not midbatch.routes_anything(midbatch.decide(at))
    assert not midbatch.routes_anything(midbatch.decide({r: {midbatch.REBUILD: 1.0} for r in midbatch.ROW_STEPS}))
    assert midbatch.path_for((), 64) == midbatch.NATIVE


@pytest.mark.parametrize(
    "raw, expected",
    [(None, None), ("", None), ("  ", None), ("all", -1), ("ALL", -1), ("8", 8 << 30), ("0.5", 1 << 29)],
)
def test_keep_budget(raw, expected):
    env = {} if raw is None else {midbatch.KEEP_ENV: raw}
    assert midbatch.keep_budget(env) == expected


@pytest.mark.parametrize("raw", ["0", "-3", "lots", "nan", "inf", "8GiB"])
def test_a_bad_keep_value_says_what_to_give(raw):
    with pytest.raises(midbatch.KeepSettingError, match="positive number"):
        midbatch.keep_budget({midbatch.KEEP_ENV: raw})


def test_the_budget_takes_layers_while_they_fit():
    budget = midbatch.Budget(midbatch.layer_bytes(5120, 17408) * 2)
    assert budget.take(midbatch.layer_bytes(5120, 17408)) and budget.take(midbatch.layer_bytes(17408, 5120))
    assert not budget.take(1)
    budget.give_back(midbatch.layer_bytes(5120, 17408))
    assert budget.take(1) and midbatch.Budget(-1).take(1 << 50)
    assert midbatch.describe_budget(None) == "off" and midbatch.describe_budget(8 << 30) == "8 GiB per GPU"


# -- the registry entry on the real wheels ------------------------------------------------------


@pytest.fixture
def p12(overlay):
    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p12_mid_batch as module

    yield module
    module.reset_state()


@needs_aphrodite
def test_p12_is_an_opt_in(overlay, p12):
    result = {r.patch.id: r for r in overlay.apply_all()}["P12"]
    assert result.status.value == "NOT_APPLICABLE" and midbatch.ENABLE_ENV in result.reason, result.reason


@pytest.mark.parametrize("env", [{midbatch.ENABLE_ENV: "1"}, {midbatch.ENABLE_ENV: "on"}, {midbatch.KEEP_ENV: "4"}])
def test_either_switch_opts_in(env):
    assert midbatch.enabled(env)
    assert not midbatch.enabled({}) and not midbatch.enabled({midbatch.ENABLE_ENV: "0", midbatch.KEEP_ENV: " "})


@needs_aphrodite
def test_p12_applies_where_the_144_row_threshold_is(overlay, p12, monkeypatch):
    monkeypatch.setenv(midbatch.ENABLE_ENV, "1")
    result = {r.patch.id: r for r in overlay.apply_all()}["P12"]
    if HAS_THRESHOLD:
        assert result.status.value == "APPLIED", result.reason
        exl3 = importlib.import_module(MODULE)
        assert exl3._EXL3_AUTO_RECONSTRUCT_THRESHOLD == 144  # the fact the write-up and the patch rely on
        assert "P12" in tags_of(vars(exl3.Exl3LinearMethod)["process_weights_after_loading"])
    else:
        assert result.status.value == "NOT_APPLICABLE" and "0.24.0" in result.reason, result.reason


@needs_aphrodite
def test_a_bad_keep_value_leaves_everything_as_it_was(overlay, p12, monkeypatch):
    exl3 = importlib.import_module(MODULE)
    before = vars(exl3.Exl3LinearMethod)["process_weights_after_loading"]
    monkeypatch.setenv(midbatch.KEEP_ENV, "lots")
    result = {r.patch.id: r for r in overlay.apply_all()}["P12"]
    assert result.status.value == "NOT_APPLICABLE" and f"{midbatch.KEEP_ENV}='lots'" in result.reason
    assert vars(exl3.Exl3LinearMethod)["process_weights_after_loading"] is before


@pytest.mark.skipif(not HAS_THRESHOLD, reason="the replaced ops route against the 144-row threshold of 0.24+")
def test_the_ops_kernels_are_replaced_and_given_back(p12, monkeypatch):
    exl3 = importlib.import_module(MODULE)

    def kernel(op):  # the function torch's CustomOpDef.register_kernel wrapped (maybe twice) for the dispatcher
        fn = op._backend_fns["cuda"]
        while fn.__name__ == "wrapped_fn":
            fn = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))["fn"]
        return fn

    originals = {name: kernel(getattr(exl3, name)) for name in p12.APHRODITE_OPS}
    assert all(fn is getattr(exl3, name)._init_fn for name, fn in originals.items())
    p12.wrap_ops()
    p12.wrap_ops()  # once each
    for name in p12.APHRODITE_OPS:
        assert kernel(getattr(exl3, name)).__name__ == f"hxf_p12{name}"
    routed = []
    monkeypatch.setattr(p12, "route", lambda name, original, x, first, rest: routed.append((name, x, first, rest)))
    kernel(exl3._exl3_linear_one)(x="x", trellis="t", suh="s", svh="v", mcg=True, mul1=False)  # keywords: bound
    assert routed == [("_exl3_linear_one", "x", "t", ("s", "v", True, False))]
    p12.reset_state()
    assert {name: kernel(getattr(exl3, name)) for name in p12.APHRODITE_OPS} == originals


# -- the router ------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_THRESHOLD, reason="the router lowers 0.24+'s threshold")
def test_the_router_takes_each_path_at_its_rows(p12):
    exl3 = importlib.import_module(MODULE)
    first = torch.zeros(4, 2, 48, dtype=torch.int16)  # a trellis's shape; only its data_ptr keys the entry
    weight = torch.randn(64, 32, dtype=torch.float16)
    seen = []

    def original(x, trellis, *rest):
        seen.append((x.shape[0], exl3._EXL3_AUTO_RECONSTRUCT_THRESHOLD))
        if rest and rest[0] == "nested":  # a fused op's inner call: routed by the outer one
            p12.route("_exl3_linear_one", original, x, trellis, ())
        return torch.ones(x.shape[0], 32, dtype=torch.float16)

    steps = ((16, midbatch.NATIVE), (128, midbatch.REBUILD), (256, midbatch.KEPT))
    p12.ENTRIES[("_exl3_linear_one", first.data_ptr())] = (steps, weight)
    x = torch.randn(200, 64, dtype=torch.float16)
    assert torch.equal(p12.route("_exl3_linear_one", original, x[:16], first, ()), torch.ones(16, 32).half())
    p12.route("_exl3_linear_one", original, x[:64], first, ())
    kept = p12.route("_exl3_linear_one", original, x[:200], first, ())
    assert torch.allclose(kept.float(), (x[:200] @ weight).float())
    assert seen == [(16, 144), (64, 0)]  # native as it is; the rebuild under a lowered threshold; kept: no call
    assert exl3._EXL3_AUTO_RECONSTRUCT_THRESHOLD == 144  # given back after the call
    seen.clear()
    p12.route("_exl3_gate_up", original, x[:64], first, ("nested",))  # no entry for this op: native, nested too
    assert seen == [(64, 144), (64, 144)]
    p12.ENTRIES[("_exl3_gate_up", first.data_ptr())] = (steps, None)
    seen.clear()
    p12.route("_exl3_gate_up", original, x[:64], first, ("nested",))
    assert seen == [(64, 0), (64, 0)]  # the inner call rebuilds under the outer call's threshold
    seen.clear()
    p12.ENTRIES[("_exl3_linear_one", first.data_ptr())] = (steps, None)
    p12.route("_exl3_linear_one", original, x[:200], first, ())  # kept without a weight: aphrodite's path
    assert seen == [(200, 144)]


@pytest.mark.skipif(not HAS_THRESHOLD, reason="the router lowers 0.24+'s threshold")
def test_a_failing_call_gives_the_threshold_back(p12):
    exl3 = importlib.import_module(MODULE)
    first = torch.zeros(4, 2, 48, dtype=torch.int16)
    p12.ENTRIES[("_exl3_linear_one", first.data_ptr())] = (((256, midbatch.REBUILD),), None)

    def broken(x, trellis, *rest):
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        p12.route("_exl3_linear_one", broken, torch.zeros(64, 64), first, ())
    assert exl3._EXL3_AUTO_RECONSTRUCT_THRESHOLD == 144 and getattr(p12._LOCAL, "depth", 0) == 0


@pytest.mark.skipif(not HAS_THRESHOLD, reason="the recorder lists the calls of a 0.24+ layer")
def test_the_recorder_lists_top_level_calls_only(p12):
    first, other = torch.zeros(2, 1, 48, dtype=torch.int16), torch.zeros(2, 1, 48, dtype=torch.int16)

    def original(x, trellis, *rest):
        if rest:
            p12.route("_exl3_linear_one", original, x, other, ())
        return torch.zeros(x.shape[0], 48 if rest else 16)

    p12._LOCAL.recorder = []
    try:
        p12.route("_exl3_qkv", original, torch.zeros(1, 32), first, ("fused",))
        p12.route("_exl3_linear_one", original, torch.zeros(1, 32), other, ())
        assert p12._LOCAL.recorder == [("_exl3_qkv", first.data_ptr(), 48), ("_exl3_linear_one", other.data_ptr(), 16)]
    finally:
        p12._LOCAL.recorder = None
