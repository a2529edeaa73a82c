"""The overlay in fresh processes: aphrodite's own plugin loader, spawn, drift, no aphrodite,
and the upstream-ready diffs applied to the real sources."""

from __future__ import annotations

import importlib.metadata
import multiprocessing
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import spawn_worker

from helpers import (
    APHRODITE_VERSION,
    HAS_UPSTREAM_BUGS,
    NO_KERNELS,
    ROOT,
    aphrodite_site,
    by_id,
    needs_aphrodite,
    needs_buggy,
    run_status,
    subprocess_env,
)


def test_entry_point_metadata_of_the_installed_distribution():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="aphrodite.general_plugins")}
    assert eps.get("hybrid_exl3_fixes") == "hybrid_exl3_fixes:register"
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("hybrid-exl3-fixes") == "hybrid_exl3_fixes.cli:main"


def test_without_aphrodite_everything_is_not_applicable(tmp_path):
    # An empty PYTHONPATH keeps the per-version aphrodite folder out of the child.
    code, report = run_status(tmp_path)
    assert code == 0
    assert {p["status"] for p in report["patches"]} == {"NOT_APPLICABLE"}
    assert report["summary"].endswith("(aphrodite not installed)")


LOADER_SCRIPT = """
import json, sys
from aphrodite.plugins import load_general_plugins
import aphrodite.model_executor.layers.quantization.exl3 as exl3
load_general_plugins()
import hybrid_exl3_fixes as overlay
layer = type("L", (), {"prefix": "model.layers.0.linear_attn.in_proj_qkv"})()
print(json.dumps({
    "results": {r.patch.id: r.status.value for r in overlay.REGISTRY.results.values()},
    "answer": repr(exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0))._shard_ids_for_layer(layer, [256, 256, 512])),
}))
"""


@needs_aphrodite
def test_aphrodite_load_general_plugins_applies_the_overlay():
    proc = subprocess.run(
        [sys.executable, "-c", LOADER_SCRIPT],
        env=subprocess_env(aphrodite_site()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    if HAS_UPSTREAM_BUGS:
        assert out["results"] == {
            "P1": "APPLIED",
            "P2": "APPLIED",
            "P2b": "APPLIED",
            "P3": NO_KERNELS,
            "P8": NO_KERNELS,
            "P12": "NOT_APPLICABLE",
            "P4": "APPLIED",
            "P5": "APPLIED",
            "P6": "UPSTREAM_FIXED" if APHRODITE_VERSION == "0.20.0" else "APPLIED",
            "P7": "APPLIED",
            "P9": "NOT_APPLICABLE",
            "P10": "NOT_APPLICABLE",
            "P13": "NOT_APPLICABLE",
            "P11": "APPLIED",
            "P14": "APPLIED",
            "P15": "APPLIED",
            "P16": "APPLIED",
        }
        applied = 10 if APHRODITE_VERSION == "0.20.0" else 11
        upstream_fixed = 1 if APHRODITE_VERSION == "0.20.0" else 0
        summary = f"hybrid-exl3-fixes: applied={applied} upstream_fixed={upstream_fixed} drifted=0"
        assert summary in proc.stdout + proc.stderr
    else:
        assert out["results"]["P1"] == "UPSTREAM_FIXED" and out["results"]["P2"] == "APPLIED"  # its MoE branch
        assert out["results"]["P5"] == "APPLIED"  # EXL3 MoE + LoRA, in every release
        assert out["results"]["P6"] == "APPLIED"  # the EXL3 shared expert's stream, 0.21+
        assert out["results"]["P7"] == "APPLIED"  # EXL3 experts over the kernel's capacity in a CUDA graph
        # padding rows' expert id -1, from 0.23.0 (0.22.0's routers do not give it)
        assert out["results"]["P9"] == ("NOT_APPLICABLE" if APHRODITE_VERSION == "0.22.0" else "APPLIED")
        # the fused kernel's context before the first capture, from 0.24.0 (idle launches skipped)
        idle_launch = APHRODITE_VERSION in ("0.22.0", "0.23.0")
        assert out["results"]["P10"] == ("NOT_APPLICABLE" if idle_launch else "APPLIED")
        assert out["results"]["P11"] == "APPLIED"  # the LoRA wrapper of an EXL3 lm_head, every release
        assert out["results"]["P12"] == "NOT_APPLICABLE"  # an opt-in (HYBRID_EXL3_FIXES_MID_BATCH=1)
        assert out["results"]["P13"] == "NOT_APPLICABLE"  # an opt-in (HYBRID_EXL3_FIXES_MOE_EXPERT_LORA=1)
        assert out["results"]["P14"] == "UPSTREAM_FIXED"  # 0.22+ load the libtorch_stable MoE kernels
    assert out["results"]["P15"] == "APPLIED"  # prompt logprobs before the GPU drafter, every release
    assert out["results"]["P16"] == "APPLIED"  # the EXL3 MoE small-batch loop over tokens, every release
    assert out["answer"] == "[(0, 1, 2)]"


@needs_aphrodite
def test_aphrodite_plugins_allowlist_without_us_is_reported():
    code, report = run_status(aphrodite_site(), APHRODITE_PLUGINS="some_other_plugin")
    assert code == 2
    assert "APHRODITE_PLUGINS" in report["plugin_gate"]
    assert report["loaded_by_aphrodite"] is False


@needs_aphrodite
def test_the_engine_s_log_names_an_off_switch_entry_that_names_no_patch():
    """What every engine process logs when aphrodite's own loader runs the plugin with a typo in the off switch."""
    proc = subprocess.run(
        [sys.executable, "-c", "from aphrodite.plugins import load_general_plugins; load_general_plugins()"],
        env=subprocess_env(aphrodite_site(), HYBRID_EXL3_FIXES_DISABLE="P99,P2", APHRODITE_LOGGING_LEVEL="INFO"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    log = proc.stdout + proc.stderr
    warning = next((line for line in log.splitlines() if "names no patch" in line), "")
    assert warning.startswith("WARN") and "HYBRID_EXL3_FIXES_DISABLE names no patch: 'P99'" in warning, log[-3000:]
    summary = next(line for line in log.splitlines() if "hybrid-exl3-fixes: applied=" in line)
    assert summary.startswith("WARN") and "disabled=1" in summary  # the line every process logs; P2 is off


@needs_aphrodite
def test_the_status_table_fits_120_columns():
    """The real table on this release (its reasons and upstream references): every line within 120 columns, each
    patch its row (tests/unit/test_cli_status.py checks narrower terminals and longer reasons)."""
    env = subprocess_env(aphrodite_site())
    env.pop("COLUMNS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_exl3_fixes.cli", "status"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(map(len, lines)) <= 120, max(lines, key=len)
    import hybrid_exl3_fixes

    for patch in hybrid_exl3_fixes.PATCHES:
        assert any(line.startswith(f"{patch.id} {patch.slug} ") for line in lines), patch.id


@needs_aphrodite
def test_status_cli_after_the_plugin_ran():
    code, report = run_status(aphrodite_site())
    assert code == 0 and report["loaded_by_aphrodite"] is True
    assert by_id(report)["P1"]["status"] == ("APPLIED" if HAS_UPSTREAM_BUGS else "UPSTREAM_FIXED")
    assert by_id(report)["P2"]["status"] == "APPLIED"  # 0.22+ still reject EXL3 MoE layers
    assert report["aphrodite"] == APHRODITE_VERSION


@needs_aphrodite
def test_spawned_process_unpickles_then_gets_the_patch(monkeypatch):
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    monkeypatch.setenv("PYTHONPATH", str(aphrodite_site()) + ":" + str(Path(__file__).parent))
    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0))  # this (parent) process is unpatched
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=spawn_worker.run, args=(pickle.dumps(method), queue))
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0
    answer = queue.get(timeout=10)
    assert answer == "[(0, 1, 2)]"


# -- drift ------------------------------------------------------------------------------------


# The drift tests edit a copy of the release's sources and check how the registry reacts: its code, not the
# release's, so they run on one buggy release (0.21.0, the one users run) and not again on 0.20.0, whose edited
# sources are the same text.
drift_once = pytest.mark.skipif(
    APHRODITE_VERSION == "0.20.0", reason="registry drift handling: the same sources as 0.21.0, run in its lane"
)


def _edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert text.count(old) >= count, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new))


def _check_untouched(site: Path, expressions: list[str]) -> None:
    """In a fresh process on the copy: apply, then each expression must be an untagged original."""
    checks = "\n".join(
        f"assert getattr(({e}), '__hybrid_exl3_fixes_patch__', None) is None, {e!r}" for e in expressions
    )
    script = f"""
import hybrid_exl3_fixes as overlay
overlay.apply_all()
from aphrodite.lora.layers import utils, base_linear, fused_moe
from aphrodite.model_executor.layers.quantization import exl3
{checks}
print("UNTOUCHED")
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], env=subprocess_env(site), capture_output=True, text=True, timeout=300
    )
    assert "UNTOUCHED" in proc.stdout, proc.stderr


@needs_buggy
@drift_once
def test_renamed_target_is_drifted_and_left_alone(aphrodite_copy):
    lora = aphrodite_copy / "aphrodite" / "lora" / "layers"
    for name in ("utils.py", "base_linear.py", "fused_moe.py"):
        _edit(lora / name, "_get_lora_device", "_lora_device_for")
    code, report = run_status(aphrodite_copy)
    assert code == 1
    p = by_id(report)
    assert p["P2"]["status"] == "DRIFTED" and "has no _get_lora_device" in p["P2"]["reason"]
    assert p["P1"]["status"] == "APPLIED"  # the other patches still apply
    _check_untouched(
        aphrodite_copy, ["utils._lora_device_for", "base_linear._lora_device_for", "fused_moe._lora_device_for"]
    )


@needs_buggy
@drift_once
def test_binding_site_that_stopped_importing_by_name_is_drifted(aphrodite_copy):
    base_linear = aphrodite_copy / "aphrodite" / "lora" / "layers" / "base_linear.py"
    _edit(
        base_linear,
        "from .utils import _get_lora_device",
        "from .utils import _get_lora_device as _upstream_device\n\n\ndef _get_lora_device(layer):\n    return _upstream_device(layer)",  # noqa: E501 (the exact text)
    )
    code, report = run_status(aphrodite_copy)
    assert code == 1
    assert by_id(report)["P2"]["status"] == "DRIFTED"
    assert "is not the object defined at aphrodite.lora.layers.utils._get_lora_device" in by_id(report)["P2"]["reason"]
    _check_untouched(aphrodite_copy, ["utils._get_lora_device", "base_linear._get_lora_device"])


@needs_buggy
@drift_once
def test_an_unknown_signature_of_the_moe_apply_is_drifted(aphrodite_copy):
    """P7's target takes two parameter lists (0.20/0.21 and 0.22+); a third is DRIFTED, the method left alone."""
    exl3 = aphrodite_copy / "aphrodite" / "model_executor" / "layers" / "quantization" / "exl3.py"
    text = exl3.read_text()
    old = (
        "        shared_experts_input: torch.Tensor | None,\n    ) -> torch.Tensor:\n        del shared_experts_input\n"
    )
    assert text.count(old) == 1  # Exl3MoEMethod.apply's last parameter
    exl3.write_text(text.replace(old, old.replace("None,\n", "None,\n        routed_scaling: float = 1.0,\n", 1)))
    code, report = run_status(aphrodite_copy)
    assert code == 1 and by_id(report)["P7"]["status"] == "DRIFTED", by_id(report)["P7"]
    assert "routed_scaling" in by_id(report)["P7"]["reason"]
    _check_untouched(aphrodite_copy, ["exl3.Exl3MoEMethod.apply"])


def _p1_drift_after(site: Path, old: str, new: str) -> str:
    """Edit the copy's exl3.py, run status in a fresh process: P1 must be DRIFTED; returns its reason."""
    _edit(site / "aphrodite" / "model_executor" / "layers" / "quantization" / "exl3.py", old, new)
    code, report = run_status(site)
    assert code == 1 and by_id(report)["P1"]["status"] == "DRIFTED", by_id(report)["P1"]
    return by_id(report)["P1"]["reason"]


@needs_buggy
@drift_once
def test_changed_signature_is_drifted_and_left_alone(aphrodite_copy):
    reason = _p1_drift_after(
        aphrodite_copy,
        "        output_partition_sizes: list[int],\n    ) -> list[str | int | tuple[int, ...] | None]:",
        "        output_partition_sizes: list[int],\n        lora: bool = False,\n    ) -> list[str | int | tuple[int, ...] | None]:",  # noqa: E501 (the exact text)
    )
    assert "lora" in reason, reason
    _check_untouched(aphrodite_copy, ["exl3.Exl3LinearMethod._shard_ids_for_layer"])


@needs_buggy
@drift_once
def test_unknown_probe_answer_is_drifted(aphrodite_copy):
    reason = _p1_drift_after(
        aphrodite_copy,
        "        return list(range(len(output_partition_sizes)))\n\n\nclass Exl3MoEMethod",
        "        return [str(i) for i in range(len(output_partition_sizes))]\n\n\nclass Exl3MoEMethod",
    )
    assert "probe" in reason, reason


# -- patches/ ---------------------------------------------------------------------------------

PATCHES = sorted((ROOT / "patches").glob("*.patch"))
# Diffs of aphrodite's Python sources (the wheels hold those); csrc diffs (0003, 0014) touch sources the
# wheels do not ship.
PYTHON_PATCHES = [p for p in PATCHES if "\ndiff --git a/aphrodite/" in p.read_text()]


def _git_apply(site: Path, patch: Path, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "apply", *(["--check"] if check else []), str(patch)], cwd=site, capture_output=True, text=True
    )


@needs_aphrodite
@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_headers(patch):
    text = patch.read_text()
    for field in ("Why:", "How:", "Upstream:", "Retire when:"):
        assert f"\n{field}" in text, f"{patch.name} lacks {field}"
    assert "\ndiff --git a/aphrodite/" in text or "\ndiff --git a/csrc/" in text


def applies_to(patch: Path, version: str) -> bool:
    """Whether the patch's header names the release ("Applies with `git apply` ... aphrodite-engine A / B.")."""
    line = next(x for x in patch.read_text().splitlines() if x.startswith("Applies with"))
    return version in line.rsplit("aphrodite-engine", 1)[1].strip(" .").split(" / ")


@needs_buggy
def test_patches_apply_and_fix_the_real_sources(aphrodite_copy):
    for patch in PYTHON_PATCHES:
        if not applies_to(patch, APHRODITE_VERSION):  # 0006: 0.20.0 has the check it restores
            continue
        proc = _git_apply(aphrodite_copy, patch)
        assert proc.returncode == 0, f"{patch.name}: {proc.stderr}"
    # The overlay's own probes now find nothing to fix in the patched sources.
    code, report = run_status(aphrodite_copy)
    assert code == 0
    assert {p["id"]: p["status"] for p in report["patches"]} == {
        "P1": "UPSTREAM_FIXED",
        "P2": "UPSTREAM_FIXED",
        "P2b": "UPSTREAM_FIXED",
        "P3": NO_KERNELS,
        "P8": NO_KERNELS,
        "P12": "NOT_APPLICABLE",  # 0.24+ only
        "P4": "UPSTREAM_FIXED",
        "P5": "UPSTREAM_FIXED",
        "P6": "UPSTREAM_FIXED",
        "P7": "UPSTREAM_FIXED",
        "P9": "NOT_APPLICABLE",  # 0009 applies to 0.23.0 / 0.24.1, where tests/unit/test_p9_moe_padding.py reads it
        "P10": "NOT_APPLICABLE",  # 0010 applies to 0.24.1, where tests/unit/test_p10_moe_context.py reads it
        "P13": "NOT_APPLICABLE",  # an opt-in
        "P11": "UPSTREAM_FIXED",
        "P14": "APPLIED",  # 0014 is a csrc diff: the copy still loads the unpatched compiled kernels
        "P15": "APPLIED",  # 0015 applies to 0.24.1, where tests/unit/test_p15_gpu_model_runner.py reads it
        "P16": "UPSTREAM_FIXED" if APHRODITE_VERSION == "0.21.0" else "APPLIED",  # 0016: 0.21.0 - 0.24.1
    }
    # The upstream-ready tests pass on the patched sources with the overlay switched off.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "upstream")],
        env=subprocess_env(aphrodite_copy, HYBRID_EXL3_FIXES_UPSTREAM_MODE="raw"),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]


@needs_buggy
def test_upstream_tests_fail_on_the_unpatched_release():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "upstream")],
        env=subprocess_env(aphrodite_site(), HYBRID_EXL3_FIXES_UPSTREAM_MODE="raw"),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    tail = proc.stdout.strip().splitlines()[-1]
    assert " failed" in tail and "passed" in tail, tail  # the fixed cases fail, the unchanged ones pass


@needs_aphrodite
def test_fixed_release_rejects_the_already_fixed_diffs(aphrodite_copy):
    if HAS_UPSTREAM_BUGS:
        pytest.skip(f"aphrodite {APHRODITE_VERSION} still needs 0001/0002")
    assert _git_apply(aphrodite_copy, PYTHON_PATCHES[0], check=True).returncode != 0
    assert _git_apply(aphrodite_copy, PYTHON_PATCHES[1], check=True).returncode != 0
    assert _git_apply(aphrodite_copy, PYTHON_PATCHES[2], check=True).returncode == 0
