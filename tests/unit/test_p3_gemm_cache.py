"""P3 without a GPU: the static probe on the real wheels' kernel libraries, the registry entry,
the load-time plan on real Exl3LinearMethod layers (fake inputs: CPU tensors), and the reading
of the runtime probe. The kernels themselves are exercised on the H200 (tests/gpu)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from helpers import APHRODITE_VERSION, ROOT, by_id, exl3_linear_layer, needs_aphrodite, run_status
from hybrid_exl3_fixes.checkpoint import codec
from hybrid_exl3_fixes.decisions import exl3_kernels as kernels
from hybrid_exl3_fixes.decisions import p3_gemm_cache as p3_plan

KERNELS = ROOT / ".cache" / "aphrodite-kernels"
# Where each release keeps its EXL3 GEMM and what its dispatch is (read from the wheels: 0.22.0 moved
# the kernels to _C_fork, 0.23.0 to _C_stable_libtorch, 0.24.0 keyed the autotuner on the codebook)
LIBRARY = {
    "0.20.0": "_C.abi3.so",
    "0.21.0": "_C.abi3.so",
    "0.22.0": "_C_fork.abi3.so",
    "0.23.0": "_C_stable_libtorch.abi3.so",
    "0.24.0": "_C_stable_libtorch.abi3.so",
    "0.24.1": "_C_stable_libtorch.abi3.so",
}
BLIND, KEYED = kernels.CODEBOOK_BLIND, kernels.CODEBOOK_KEYED
EXPECTED = {"0.20.0": BLIND, "0.21.0": BLIND, "0.22.0": BLIND, "0.23.0": BLIND, "0.24.0": KEYED, "0.24.1": KEYED}


def kernel_library(version: str) -> Path:
    path = KERNELS / version / "aphrodite" / LIBRARY[version]
    if not path.is_file():
        pytest.skip(
            f"{path} not unpacked: ci/aphrodite-versions.sh {version} extracts it (0.24.0 is not a default lane)"
        )
    return path


# -- the static probe on the real binaries ---------------------------------------------------


@pytest.mark.parametrize("version", sorted(EXPECTED))
def test_kernel_dispatch_is_read_from_the_real_binaries(version):
    verdict, evidence = kernels.classify_build([kernel_library(version)])
    assert verdict == EXPECTED[version], evidence


def test_library_without_exl3_and_non_elf_files(tmp_path):
    no_exl3 = KERNELS / "0.21.0" / "aphrodite" / "_C_stable_libtorch.abi3.so"
    if not no_exl3.is_file():
        pytest.skip(f"{no_exl3} not unpacked")
    assert kernels.classify_build([no_exl3])[0] is None
    text = tmp_path / "_C.abi3.so"
    text.write_text("not a library")
    with pytest.raises(kernels.KernelLibraryError, match="not a 64-bit little-endian ELF"):
        kernels.classify_library(text)


def test_library_with_an_unknown_exl3_dispatch_is_drift(tmp_path):
    """A build whose EXL3 GEMM has neither known dispatch: the real 0.21 library with the
    blind symbol's name overwritten (same length, so the ELF stays valid)."""
    lib = tmp_path / "_C.abi3.so"
    data = kernel_library("0.21.0").read_bytes()
    lib.write_bytes(data.replace(kernels.BLIND_SYMBOL, kernels.BLIND_SYMBOL.replace(b"new", b"xyz")))
    verdict, evidence = kernels.classify_build([lib])
    assert verdict == kernels.UNKNOWN_DISPATCH and "neither" in evidence


# -- the registry entry, in fresh processes ------------------------------------------------------


@needs_aphrodite
def test_status_without_compiled_kernels_is_not_applicable():
    # the unpacked CI tree has no .so files: nothing to patch, and nothing to worry about
    code, report = run_status(os.environ.get("PYTHONPATH"))
    p3 = by_id(report)["P3"]
    assert p3["status"] == "NOT_APPLICABLE" and "no EXL3 GEMM" in p3["reason"], p3
    assert code == 0


@needs_aphrodite
def test_status_with_the_real_kernel_library(aphrodite_copy):
    """The copy of the installed aphrodite gets its release's real kernel library: P3 is
    APPLIED on 0.20-0.23 (codebook-blind cache) and UPSTREAM_FIXED from 0.24.0 -- and the other
    patches still report as before with a _C that cannot load on this CPU machine."""
    lib = kernel_library(APHRODITE_VERSION)
    (aphrodite_copy / "aphrodite" / lib.name).symlink_to(lib)
    code, report = run_status(aphrodite_copy)
    p = by_id(report)
    want = "APPLIED" if EXPECTED[APHRODITE_VERSION] == kernels.CODEBOOK_BLIND else "UPSTREAM_FIXED"
    assert p["P3"]["status"] == want, p["P3"]
    assert all(p[i]["status"] in ("APPLIED", "UPSTREAM_FIXED") for i in ("P1", "P2", "P2b")), p
    assert code == 0


@needs_aphrodite
def test_probe_and_apply_in_process(overlay, monkeypatch):
    """Unpatched 0.21 (a blind library) -> the probe says buggy; after apply it says fixed, the
    class attribute is the tagged wrapper, and undo restores the raw original."""
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p3_gemm_cache as p13

    version = APHRODITE_VERSION if APHRODITE_VERSION in EXPECTED else "0.21.0"
    monkeypatch.setattr(kernels, "installed_kernel_libraries", lambda: [kernel_library(version)])
    original = vars(exl3.Exl3LinearMethod)["process_weights_after_loading"]
    result = overlay.REGISTRY.apply(p13.PATCH)
    if EXPECTED[version] == kernels.CODEBOOK_KEYED:
        assert result.status.value == "UPSTREAM_FIXED"
        assert vars(exl3.Exl3LinearMethod)["process_weights_after_loading"] is original
        return
    assert result.status.value == "APPLIED", result.reason
    patched = vars(exl3.Exl3LinearMethod)["process_weights_after_loading"]
    assert patched is not original and patched.__wrapped__ is original
    overlay.undo_all()
    assert vars(exl3.Exl3LinearMethod)["process_weights_after_loading"] is original


# -- the load-time plan ---------------------------------------------------------------------------

BLIND = p3_plan.ProbeVerdict(True, True, "test")


@pytest.fixture
def plan(monkeypatch):
    """P3's module with a fresh planner and warning flag; returns it."""
    pytest.importorskip("aphrodite.model_executor.layers.quantization.exl3", reason="needs aphrodite")
    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p3_gemm_cache as p13

    monkeypatch.setattr(p13, "PLANNER", p3_plan.Planner())
    monkeypatch.setattr(p13, "_warned", False)
    return p13


def linear(codebook: str, fin: int = 512, fout: int = 256, K: int = 4, seed: int = 0):
    return codec.random_exl3_linear(fin, fout, K, codebook, torch.Generator().manual_seed(seed))


def loaded(plan, prefix, shards):
    """A real Exl3LinearMethod and its layer after loading (mgemm set up by aphrodite's own code)."""
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0))
    layer = exl3_linear_layer(exl3, method, prefix, shards)
    exl3.Exl3LinearMethod._setup_mgemm_if_supported(layer)
    return method, layer


def test_single_codebook_model_is_not_touched(plan):
    for i in range(4):
        method, layer = loaded(plan, f"model.layers.{i}.mlp.down_proj", {None: linear("mcg")})
        assert plan.plan_layer(method, layer, BLIND) == {}
        assert "_apply_one" not in vars(method) and not hasattr(layer, "hxf_exl3_routes")


def test_second_codebook_on_a_key_is_routed_and_warned_once(plan, caplog):
    caplog.set_level(logging.INFO, logger="aphrodite.hybrid_exl3_fixes")
    order = ["mcg", "mul1", "3inst", "mcg", "mul1"]
    routes = []
    for i, cb in enumerate(order):
        method, layer = loaded(plan, f"model.layers.{i}.mlp.down_proj", {None: linear(cb)})
        routes.append(plan.plan_layer(method, layer, BLIND, device_class="hopper", device_sms=132))
        if routes[-1]:
            assert vars(method)["_apply_one"].__func__ is plan._routed_apply_one
    assert [bool(r) for r in routes] == [False, True, True, False, True]
    assert routes[1][None] == kernels.forced_launch("hopper", 512, 256, 4, 132)
    assert plan.PLANNER.owners[(512, 256, 4)][0] == "mcg"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "model.layers.1.mlp.down_proj" in warnings[0].getMessage()
    assert sum("P3:" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO) == 2


def test_other_bitrates_and_shapes_are_other_keys(plan):
    for i, (cb, fin, fout, K) in enumerate([("mcg", 512, 256, 4), ("mul1", 512, 256, 3), ("3inst", 256, 512, 4)]):
        method, layer = loaded(plan, f"model.layers.{i}.mlp.down_proj", {None: linear(cb, fin, fout, K)})
        assert plan.plan_layer(method, layer, BLIND) == {}


def test_fused_gate_up_takes_mgemm_and_claims_nothing(plan):
    method, layer = loaded(
        plan, "model.layers.0.mlp.gate_up_proj", {0: linear("mul1", 256, 512), 1: linear("mul1", 256, 512, seed=1)}
    )
    assert layer.exl3_can_mgemm and layer.exl3_mgemm_mode == "gate_up"
    assert plan.plan_layer(method, layer, BLIND) == {} and plan.PLANNER.owners == {}


def test_conflicting_q_of_a_fused_qkv_unfuses_k_and_v(plan):
    method, layer = loaded(plan, "model.layers.0.mlp.down_proj", {None: linear("mcg", 256, 512)})
    plan.plan_layer(method, layer, BLIND)  # owns (256, 512, 4) for mcg
    qkv = {"q": linear("mul1", 256, 512), "k": linear("mul1", 256, 256), "v": linear("mul1", 256, 256, seed=2)}
    method, layer = loaded(plan, "model.layers.3.self_attn.qkv_proj", qkv)
    assert layer.exl3_can_mgemm and layer.exl3_mgemm_mode == "qkv_kv"
    routes = plan.plan_layer(method, layer, BLIND)
    assert list(routes) == ["q"] and not layer.exl3_can_mgemm
    assert plan.PLANNER.owners[(256, 256, 4)] == ("mul1", "model.layers.3.self_attn.qkv_proj['k']")


def test_planning_is_a_no_op_when_the_probe_finds_no_bug(plan):
    for verdict in (p3_plan.ProbeVerdict(False, True, "keyed"), p3_plan.ProbeVerdict(None, True, "unclear")):
        for i, cb in enumerate(("mcg", "mul1")):
            method, layer = loaded(plan, f"model.layers.{i}.mlp.down_proj", {None: linear(cb)})
            assert plan.plan_layer(method, layer, verdict) == {}
    assert plan.PLANNER.owners == {}


def test_wrong_uncached_launch_falls_back_to_reconstruct(plan):
    verdict = p3_plan.ProbeVerdict(True, False, "forced launch wrong")
    for i, cb in enumerate(("mcg", "mul1")):
        method, layer = loaded(plan, f"model.layers.{i}.mlp.down_proj", {None: linear(cb)})
        routes = plan.plan_layer(method, layer, verdict)
    assert routes == {None: (0, 0)}


def test_any_load_order_leaves_one_codebook_per_key_on_the_cached_path():
    """Whatever order layers load in, only owners call the cached kernel, so each key's cache
    entry is its owner's codebook whichever layer runs first."""
    import itertools

    layers = [
        ("a", (512, 256, 4), "mcg"),
        ("b", (512, 256, 4), "mul1"),
        ("c", (512, 256, 4), "3inst"),
        ("d", (512, 256, 3), "mul1"),
        ("e", (512, 256, 4), "mcg"),
    ]
    for order in itertools.permutations(layers):
        planner = p3_plan.Planner()
        native = {}
        for name, key, cb in order:
            if planner.claim(key, cb, name) is None:
                native.setdefault(key, set()).add(cb)
        assert all(len(cbs) == 1 for cbs in native.values()), (order, native)
        assert len(planner.routed) == sum(1 for _, key, cb in order if planner.owners[key][0] != cb)


# -- reading the runtime probe and choosing launches ----------------------------------------------


def test_read_probe():
    right = {"forced_3inst": 5e-4, "forced_mcg": 5e-4, "forced_mul1": 5e-4}
    blind = p3_plan.read_probe({"first": 5e-4, "second": 1.6, "second_vs_first": 5e-4, **right})
    assert blind.codebook_blind is True and blind.forced_ok
    keyed = p3_plan.read_probe({"first": 5e-4, "second": 6e-4, "second_vs_first": 1.6, **right})
    assert keyed.codebook_blind is False
    odd = p3_plan.read_probe({"first": 5e-4, "second": 0.3, "second_vs_first": 0.3, **right})
    assert odd.codebook_blind is None and "neither" in odd.detail
    broken = p3_plan.read_probe({"first": 1.2, "second": 1.6, "second_vs_first": 5e-4, **right})
    assert broken.codebook_blind is None
    wrong_forced = p3_plan.read_probe(
        {"first": 5e-4, "second": 1.6, "second_vs_first": 5e-4, **right, "forced_mul1": 1.6}
    )
    assert wrong_forced.codebook_blind is True and not wrong_forced.forced_ok


@pytest.mark.parametrize("cc", ["ampere", "ada", "hopper", "blackwell"])
@pytest.mark.parametrize(
    "k,n", [(5120, 17408), (17408, 5120), (5120, 6144), (6144, 5120), (256, 128), (4096, 384), (272, 640)]
)
@pytest.mark.parametrize("K", [2, 3, 4, 8])
def test_forced_launch_tiles_the_layer(cc, k, n, K):
    shape, sms = kernels.forced_launch(cc, k, n, K, 132)
    assert kernels.shape_fits(shape, k, n)
    assert 1 <= sms <= min(132, (k // kernels.TILE_K[shape]) * (n // kernels.TILE_N[shape]))


def test_forced_launch_for_untileable_output():
    assert kernels.forced_launch("hopper", 256, 200, 4, 132) is None


def test_compute_class():
    assert [kernels.compute_class(*cc) for cc in [(8, 0), (8, 6), (8, 9), (9, 0), (12, 0)]] == [
        "ampere",
        "ampere",
        "ada",
        "hopper",
        "blackwell",
    ]


def test_a_probe_that_raises_routes_nothing_and_warns_once(plan, monkeypatch, caplog):
    """On a device where the probe's own GEMM fails, P3 must not retry (and warn) for every layer:
    the failure is the device's cached verdict. Fake inputs: the device's properties and the probe's
    measurement (this project's function), so it runs without a GPU."""
    from types import SimpleNamespace

    monkeypatch.setattr(plan, "VERDICTS", {})
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(major=8, minor=6, multi_processor_count=84)
    )
    monkeypatch.setattr(torch.cuda, "device", lambda i: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    calls = []

    def failing(*args):
        calls.append(args)
        raise RuntimeError("Failed to find valid kernel for shape")

    monkeypatch.setattr(plan, "measure_gemm_cache", failing)
    caplog.set_level(logging.INFO, logger="aphrodite.hybrid_exl3_fixes")
    for i, cb in enumerate(("mcg", "mul1", "3inst")):
        method, layer = loaded(plan, f"model.layers.{i}.mlp.down_proj", {None: linear(cb)})
        assert plan.plan_layer(method, layer) == {}
    assert len(calls) == 1 and plan.VERDICTS[0].codebook_blind is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Failed to find valid kernel" in warnings[0]


def test_undo_resets_what_p3_changed_at_load(plan):
    """P3's state is its own and undo resets it: the routed layer's instance ``_apply_one`` and routes go, the
    unfused qkv gets its ``exl3_can_mgemm`` back, the planner, verdicts and warn-once flag start afresh."""
    method, layer = loaded(plan, "model.layers.0.mlp.down_proj", {None: linear("mcg", 256, 512)})
    plan.plan_layer(method, layer, BLIND)
    qkv = {"q": linear("mul1", 256, 512), "k": linear("mul1", 256, 256), "v": linear("mul1", 256, 256, seed=2)}
    method, layer = loaded(plan, "model.layers.3.self_attn.qkv_proj", qkv)
    assert plan.plan_layer(method, layer, BLIND) and not layer.exl3_can_mgemm and "_apply_one" in vars(method)
    plan.VERDICTS[0] = BLIND
    assert plan.PATCH.on_undo is plan.reset_state
    plan.PATCH.on_undo()
    assert layer.exl3_can_mgemm and "_apply_one" not in vars(method) and not hasattr(layer, "hxf_exl3_routes")
    assert plan.PLANNER.owners == {} and plan.VERDICTS == {} and plan._warned is False and plan._CHANGED == []


@needs_aphrodite  # the registry answers NOT_APPLICABLE for every patch where aphrodite is not installed
def test_registry_undo_runs_the_patch_reset():
    from helpers import stand_in_patch
    from hybrid_exl3_fixes.registry import Registry

    calls = []
    patch, Owner = stand_in_patch(globals(), "Owner", on_undo=lambda: calls.append("reset"))
    registry = Registry([patch])
    result = registry.apply(patch)
    assert result.status.value == "APPLIED" and Owner().f() == "fixed", result.reason
    assert registry.undo(patch) and Owner().f() == "bug" and calls == ["reset"]
