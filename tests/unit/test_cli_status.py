"""``hybrid-exl3-fixes status`` (overlay/cli_status.py, CPU, no aphrodite needed): the off switch's unknown entries
warned of with the ids that exist (exit 1), and the table within 120 columns (a narrower terminal's down to 80).
tests/unit/test_processes.py runs status against each release's real aphrodite."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import run_status, subprocess_env


def status_text(pythonpath, **extra: str) -> subprocess.CompletedProcess:
    """``hybrid-exl3-fixes status`` (the table) in a fresh process, COLUMNS as ``extra`` sets it or unset."""
    env = subprocess_env(pythonpath, **extra)
    if "COLUMNS" not in extra:
        env.pop("COLUMNS", None)
    return subprocess.run(
        [sys.executable, "-m", "hybrid_exl3_fixes.cli", "status"], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "value, unknown", [("P99", ["P99"]), ("P1;P2", ["P1;P2"]), ("p2b, P99 ,exl3-gemm-codebook-cache", ["P99"])]
)
def test_an_off_switch_entry_that_names_no_patch_is_a_warning_in_status(tmp_path, value, unknown):
    """A typo in HYBRID_EXL3_FIXES_DISABLE switches nothing off: status names it and the ids that exist, exit 1."""
    code, report = run_status(tmp_path, HYBRID_EXL3_FIXES_DISABLE=value)
    assert code == 1 and report["off_switch_unknown"] == unknown
    proc = status_text(tmp_path, HYBRID_EXL3_FIXES_DISABLE=value)
    assert proc.returncode == 1
    said = " ".join(proc.stdout.split())
    assert f"WARNING: HYBRID_EXL3_FIXES_DISABLE names no patch: {', '.join(map(repr, unknown))}" in said, said
    assert "P1,P2,P2b,P3,P4,P5,P6,P7,P8,P9,P10,P11,P12,P13,P14,P15,P16 (separated by commas)" in said


@pytest.mark.parametrize("value", ["P1,p2b", "exl3-gemm-codebook-cache", "1", "all", "0"])
def test_an_off_switch_that_names_patches_warns_of_nothing(value):
    import hybrid_exl3_fixes as overlay

    with pytest.MonkeyPatch.context() as env:
        env.setenv(overlay.DISABLE_ENV, value)
        assert overlay.REGISTRY.unknown_disabled() == [] and overlay.off_switch_warning() is None


def long_results():
    """Every patch with a reason far longer than a line (what a DRIFTED result's probe message can be)."""
    import hybrid_exl3_fixes as overlay
    from hybrid_exl3_fixes.registry import Result, Status

    return [
        Result(p, Status.DRIFTED, f"target {p.slug} changed: " + "the probe's long account " * 12)
        for p in overlay.PATCHES
    ]


@pytest.mark.parametrize("width", [80, 100, 120])
def test_the_table_wraps_every_line_within_its_width(width):
    from hybrid_exl3_fixes.cli_status import render_table

    results = long_results()
    lines = render_table(results, width)
    assert max(map(len, lines)) <= width, max(lines, key=len)
    for result in results:  # each patch its row, and all of its reason and upstream reference kept
        assert any(line.startswith(f"{result.patch.id} {result.patch.slug} ") for line in lines)
    words = " ".join(lines).split()
    for result in results:
        assert result.patch.upstream.split()[0] in words


@pytest.mark.parametrize("columns, width", [(None, 120), ("80", 80), ("300", 120)])
def test_status_fits_the_terminal_up_to_120_columns(tmp_path, columns, width):
    proc = status_text(tmp_path, **({"COLUMNS": columns} if columns else {}))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(map(len, lines)) <= width, max(lines, key=len)
