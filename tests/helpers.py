"""Shared helpers, imported as `helpers` (tests/conftest.py puts tests/ on sys.path).

Tests run against whichever real aphrodite-engine is importable
(ci/test.sh runs the suite once per version with PYTHONPATH=.cache/aphrodite/<version>, and once
without aphrodite). Expectations use the version; the overlay itself never does."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_APHRODITE = importlib.util.find_spec("aphrodite") is not None
try:
    APHRODITE_VERSION = importlib.metadata.version("aphrodite-engine") if HAS_APHRODITE else None
except importlib.metadata.PackageNotFoundError:
    APHRODITE_VERSION = "unknown"
# Which releases carry P1's and P2's bugs: read from the wheels (0.22.0 has dphnAI/sonar #1711 and #1712).
HAS_UPSTREAM_BUGS = APHRODITE_VERSION in ("0.20.0", "0.21.0")

_NO_APHRODITE = "aphrodite-engine not importable in this run (ci/test.sh runs each version)"
needs_aphrodite = pytest.mark.skipif(not HAS_APHRODITE, reason=_NO_APHRODITE)
needs_buggy = pytest.mark.skipif(
    not HAS_UPSTREAM_BUGS,
    reason=_NO_APHRODITE
    if not HAS_APHRODITE
    else f"aphrodite {APHRODITE_VERSION} does not carry bugs 1/2 (only 0.20.0, 0.21.0 do)",
)
# The per-version trees hold no compiled extensions, so P3 (which reads the kernel library) has
# nothing to patch there; test_p3_gemm_cache.py gives a copy the release's real library.
NO_KERNELS = "NOT_APPLICABLE"
needs_fixed = pytest.mark.skipif(
    not HAS_APHRODITE or HAS_UPSTREAM_BUGS,
    reason=_NO_APHRODITE
    if not HAS_APHRODITE
    else f"aphrodite {APHRODITE_VERSION} is not a release with the upstream fixes",
)

# Test files that read no aphrodite code (the checkpoint writer and its codec, the benchmarks' drivers and
# reports against stand-in servers, the stub builder, the memory plan's formulas, the package build, the GPU
# driver's stage scripts): their outcome cannot depend on the release, so in a lane with aphrodite they are
# skipped and ci/test.sh runs them once, in the lane without it. tests/unit/test_conftest_lanes.py checks that
# none of them imports aphrodite or asks for a release. HXF_EVERY_LANE=1 runs them in every lane.
VERSION_INDEPENDENT = (
    "test_serving_http.py",
    "test_serving.py",
    "test_cli.py",
    "test_cli_status.py",
    "test_codec.py",
    "test_compare_report.py",
    "test_exllamav3_generator.py",
    "test_pause.py",
    "test_same_run.py",
    "test_devstage_resplit.py",
    "test_device_bg.py",
    "test_exllamav3_layout.py",
    "test_fetch_wheel.py",
    "test_memory_arithmetic.py",
    "test_memory_profile.py",
    "test_mtp_acceptance.py",
    "test_packaging.py",
    "test_roofline.py",
    "test_server_suite.py",
    "test_staging.py",
    "test_stubs.py",
    "test_tiny.py",
)


def upstream_repro(name: str):
    """The reproduction script docs/upstream/repro/NAME.py of a write-up, imported as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "upstream" / "repro" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def aphrodite_site() -> Path:
    """The folder that holds the importable aphrodite package and its dist-info."""
    import aphrodite

    return Path(aphrodite.__file__).resolve().parents[1]


def subprocess_env(pythonpath: Path | str | None, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYBRID_EXL3_FIXES_DISABLE", "APHRODITE_PLUGINS")
    }
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    env.update(extra)
    return env


def run_status(pythonpath: Path | str | None, **extra: str) -> tuple[int, dict]:
    """``hybrid-exl3-fixes status --json`` in a fresh process; returns (exit code, parsed JSON). stdout
    must be the JSON document alone (aphrodite's log lines go to stderr), as a script piping it expects."""
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_exl3_fixes.cli", "status", "--json"],
        env=subprocess_env(pythonpath, **extra),
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        return proc.returncode, json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise AssertionError(
            f"stdout is not one JSON document (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        ) from None


def by_id(report: dict) -> dict[str, dict]:
    return {p["id"]: p for p in report["patches"]}


def exl3_param(exl3):
    """The real Exl3Parameter without its constructor, which asks for the TP group."""
    param = exl3.Exl3Parameter.__new__(exl3.Exl3Parameter, weight_loader=exl3._exl3_weight_loader)
    param.exl3_tensors = {}
    return param


def exl3_linear_layer(exl3, method, prefix: str, shards: dict, device: str = "cpu"):
    """A loaded EXL3 linear as ``create_weights`` (TP=1) and the checkpoint loader leave it: the
    real ``Exl3Parameter``s, filled through aphrodite's own ``_exl3_weight_loader``.

    ``shards``: {shard id: tensors of ``codec.random_exl3_linear``} in the layer's shard order
    (``None`` for a single-shard layer). ``create_weights`` itself needs CUDA and the TP group,
    so its bookkeeping is replayed here."""
    import torch

    layer = torch.nn.Module()
    layer.prefix = prefix
    first = next(iter(shards.values()))
    in_features = first["trellis"].shape[0] * 16
    outs = [t["trellis"].shape[1] * 16 for t in shards.values()]
    layer.exl3_tp_rank, layer.exl3_tp_size = 0, 1
    layer.exl3_input_size = layer.input_size_per_partition = in_features
    layer.exl3_output_size, layer.exl3_output_partition_sizes = sum(outs), outs
    layer.exl3_shard_ids = list(shards)
    layer.exl3_parallel_mode = "column"
    for name in ("suh", "svh", "trellis", "mcg", "mul1"):
        layer.register_parameter(name, exl3_param(exl3))
    for shard_id, tensors in shards.items():
        for name, tensor in tensors.items():
            exl3._exl3_weight_loader(getattr(layer, name), tensor.to(device), shard_id)
    return layer


def install_fake_aphrodite(tmp_path: Path, monkeypatch, script: str) -> Path:
    """An executable ``aphrodite`` stand-in (``script``, a Python program whose first line is
    ``#!{python}``) first on PATH, where tests/gpu/server.py's Server finds the console script; returns
    tmp_path. The stand-in is a fake input: the code under test starts and talks to it as to the real one."""
    import stat

    bindir = tmp_path / "bin"
    bindir.mkdir()
    path = bindir / "aphrodite"
    path.write_text(script.replace("{python}", sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def free_port() -> int:
    """A port no other process holds (ci/test.sh runs the suite in several lanes at once)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_exl3_moe_layer(threshold=2, experts=4, top_k=2, hidden=16):
    """The attributes ``Exl3MoEMethod.apply`` reads of its layer (0.23+), with CPU tensors: a fake input for the real
    method, which then stops where the kernels are needed."""
    import types

    import torch
    from aphrodite.model_executor.layers.fused_moe.activation import MoEActivation

    return types.SimpleNamespace(
        activation=MoEActivation.SILU,
        expert_map=None,
        apply_router_weight_on_input=False,
        exl3_small_batch_threshold=threshold,
        hidden_size=hidden,
        local_num_experts=experts,
        top_k=top_k,
        exl3_gate_ptrs_trellis=torch.zeros(experts, dtype=torch.long),
        exl3_moe_max_tokens_per_expert=128,
        exl3_moe_short_token_threshold=0,
        exl3_moe_short_max_tokens_per_expert=128,
    )


def stand_in_patch(namespace: dict, name: str, **fields):
    """A Patch over ``namespace[name].f`` of a fresh class whose ``f`` returns "bug" (the probe's bug), replaced
    by one returning "fixed"; ``namespace`` is the calling test module's ``globals()``. Returns (patch, class)."""
    from hybrid_exl3_fixes.registry import Patch, Target

    class Owner:
        def f(self):
            return "bug"

    namespace[name] = Owner
    key = f"{namespace['__name__']}.{name}.f"
    patch = Patch(
        id=fields.pop("id", "PX"),
        slug="stand-in",
        title="stand-in",
        upstream="-",
        fixed_in=None,
        retire_when="-",
        targets=(Target(namespace["__name__"], f"{name}.f", params=("self",)),),
        probe=lambda live: live[key].function(None) == "bug",
        build=lambda live: {key: lambda self: "fixed"},
        **fields,
    )
    return patch, Owner


def fused_moe_config(hidden=256, inter=256, experts=4, top_k=2, device="cpu", dtype=None):
    """A real ``FusedMoEConfig`` (LoRA on, SiLU, no parallelism); the defaults are the tiny MoE's shape. The field
    names of the running release are used (0.21 names the intermediate size ``intermediate_size_per_partition``)."""
    import dataclasses

    import torch
    from aphrodite.model_executor.layers.fused_moe import config
    from aphrodite.model_executor.layers.fused_moe.activation import MoEActivation

    values = dict(
        num_experts=experts,
        experts_per_token=top_k,
        hidden_dim=hidden,
        intermediate_size_per_partition=inter,
        intermediate_size=inter,
        num_local_experts=experts,
        num_logical_experts=experts,
        activation=MoEActivation.SILU,
        device=device,
        routing_method=next(iter(config.RoutingMethodType)),
        moe_parallel_config=config.FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=dtype or torch.bfloat16,
        is_lora_enabled=True,
    )
    names = {f.name for f in dataclasses.fields(config.FusedMoEConfig)}
    return config.FusedMoEConfig(**{k: v for k, v in values.items() if k in names})
