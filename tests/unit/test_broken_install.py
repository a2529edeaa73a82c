"""A broken aphrodite install is not drift: when a package aphrodite itself needs is missing, the
patches that target the modules importing it report BROKEN_INSTALL naming the package, the summary
line counts it and ``status`` exits 3. Real wheels; the missing package is made unimportable in the
child process (``sys.modules[name] = None``, what Python does for a blocked import), aphrodite's
own modules are untouched."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import APHRODITE_VERSION, aphrodite_site, needs_aphrodite, subprocess_env

STATUS_WITHOUT = """
import sys
sys.modules[sys.argv[1]] = None
from hybrid_exl3_fixes.cli import main
sys.exit(main(["status", "--json"]))
"""


def status_without(package: str) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-c", STATUS_WITHOUT, package],
        env=subprocess_env(aphrodite_site()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, json.loads(proc.stdout), proc.stderr


@needs_aphrodite
@pytest.mark.parametrize("package", ["cbor2", "llguidance"])
def test_a_missing_dependency_is_a_broken_install_not_drift(package):
    code, report, stderr = status_without(package)
    statuses = {p["id"]: p for p in report["patches"]}
    broken = [p for p in statuses.values() if p["status"] == "BROKEN_INSTALL"]
    if package == "llguidance" and not APHRODITE_VERSION.startswith("0.24."):
        # before 0.24 the EXL3 and LoRA layer modules do not import llguidance; the worker's LoRA manager
        # (P5's lora/worker_manager.py) and the GPU model runner (P15's), through v1/structured_output, do, in
        # every release
        assert [p["id"] for p in broken] == ["P5", "P15"] and code == 3, statuses
        assert "pip install llguidance" in broken[0]["reason"]
        return
    # the case (0.24.1 without llguidance) and cbor2, which every release's exl3 chain imports
    assert broken and statuses["P1"]["status"] == "BROKEN_INSTALL", statuses
    assert all(
        f"the package '{package}' it needs is not installed" in p["reason"] and f"pip install {package}" in p["reason"]
        for p in broken
    )
    assert "DRIFTED" not in {p["status"] for p in statuses.values()}
    assert f"broken_install={len(broken)}" in report["summary"]
    assert code == 3
    # aphrodite's own logger may log its plugins' import errors; no traceback of this command's
    ours = [line for line in stderr.splitlines() if not line.startswith(("ERROR", "WARN", "INFO", "DEBUG"))]
    assert not any("Traceback" in line for line in ours), stderr[-2000:]


@needs_aphrodite
def test_the_text_table_says_the_install_is_broken():
    proc = subprocess.run(
        [sys.executable, "-c", STATUS_WITHOUT.replace('"--json"', ""), "cbor2"],
        env=subprocess_env(aphrodite_site()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 3
    assert "ERROR: the aphrodite install is broken, not the patches" in proc.stdout and "'cbor2'" in proc.stdout


def test_an_aphrodite_module_that_is_gone_is_still_drift():
    from hybrid_exl3_fixes.registry import BrokenInstall, Drift, classify_import_error

    gone = ModuleNotFoundError("No module named 'aphrodite.lora.layers.utils'", name="aphrodite.lora.layers.utils")
    assert isinstance(classify_import_error("aphrodite.lora.layers.utils", gone), Drift)
    moved = ImportError("cannot import name 'X' from 'aphrodite.lora.utils'", name="aphrodite.lora.utils")
    assert isinstance(classify_import_error("aphrodite.lora.layers.utils", moved), Drift)
    dep = ModuleNotFoundError("No module named 'llguidance'", name="llguidance")
    assert isinstance(classify_import_error("aphrodite.model_executor.layers.quantization.exl3", dep), BrokenInstall)
    old = ImportError("cannot import name 'Grammar' from 'xgrammar'", name="xgrammar")
    found = classify_import_error("aphrodite.x", old)
    assert isinstance(found, BrokenInstall) and "does not provide what it needs" in str(found)


@needs_aphrodite
def test_status_is_quiet_unless_something_is_wrong():
    """aphrodite's import-time notices (no libcuda on this machine, Triton without a driver, UCX) do not reach
    the status output; the table, the summary line and the off switch do."""
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_exl3_fixes.cli", "status"],
        env=subprocess_env(aphrodite_site()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1), out[-2000:]
    assert not any(word in out for word in ("libcuda", "Triton", "UCX_")), out[:2000]
    assert out.lstrip().startswith("patch ") and "hybrid-exl3-fixes: applied=" in out and "Off switch:" in out
