"""Where EXL3 MoE serves per release (overlay/compat.py): the README's compatibility table says the same, and
doctor's moe-release check follows it for the release installed in this lane."""

from __future__ import annotations

import json
import re

import pytest

from helpers import APHRODITE_VERSION, HAS_APHRODITE, ROOT
from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
from hybrid_exl3_fixes.compat import MOE_SERVING, SERVED

CELL_START = {
    "compiled": "default compiled mode",
    "eager": "eager only",
    "none": "does not start",
    "not run": "not run on a GPU",
}


def readme_moe_column() -> dict[str, str]:
    """{release: its "EXL3 MoE with the overlay" and evidence cells} from docs/evidence.md's generated table."""
    text = (ROOT / "docs" / "evidence.md").read_text()
    table = text.split("<!-- moe-serving:begin -->\n", 1)[1].split("<!-- moe-serving:end -->", 1)[0].splitlines()
    rows = {}
    for line in table[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = " ".join(cells[1:])
    return rows


def test_the_readme_table_says_what_compat_says():
    column = readme_moe_column()
    assert set(MOE_SERVING) <= set(column), set(MOE_SERVING) - set(column)
    for version, entry in MOE_SERVING.items():
        cell = column[version]
        assert cell.startswith(CELL_START[entry.kind]), (version, cell, entry)
        runs = re.findall(r"runs? (\d+)(?: and (\d+))?", entry.evidence)
        for number in {n for pair in runs for n in pair if n}:
            assert number in cell, (version, number, cell)


def test_every_served_release_names_a_gpu_run_whose_record_is_here():
    """A release is "compiled" only on the evidence of a GPU run: the entry names the run, and the run's record is in
    docs/gpu-runs/ (a page per run, its folder named DATE-runN)."""
    assert SERVED
    records = {int(p.name.rsplit("-run", 1)[1]) for p in (ROOT / "docs" / "gpu-runs").glob("*-run*") if p.is_dir()}
    for version in SERVED:
        named = {
            int(n)
            for pair in re.findall(r"runs? (\d+)(?: and (\d+))?", MOE_SERVING[version].evidence)
            for n in pair
            if n
        }
        assert named, (version, MOE_SERVING[version].evidence)
        assert named <= records, (version, named - records)


@pytest.fixture(scope="module")
def moe_shape(tmp_path_factory):
    from hybrid_exl3_fixes import doctor

    dest = tmp_path_factory.mktemp("compat")
    write_tiny(dest / "m", TinySpec.preset("tiny-moe"), dense=False)
    return doctor.parse_config(json.loads((dest / "m" / "exl3" / "config.json").read_text()))[0]


def moe_release(shape, version):
    from hybrid_exl3_fixes import doctor

    report = doctor.Report("m")
    doctor.check_moe_release(report, shape, version)
    return report.findings


@pytest.mark.parametrize("version", [*MOE_SERVING, "0.19.0"])
def test_doctor_follows_the_table(moe_shape, version):
    (found,) = moe_release(moe_shape, version)
    entry = MOE_SERVING.get(version)
    expected = {"compiled": "OK", "eager": "WARN", "none": "BLOCK", "not run": "WARN"}[
        entry.kind if entry else "not run"
    ]
    assert found.check == "moe-release" and found.level == expected, found.message
    assert version in found.message
    if expected != "OK":  # where it does serve, named
        assert all(v in found.message for v in SERVED), found.message


def test_doctor_is_silent_without_aphrodite_or_moe(moe_shape):
    from hybrid_exl3_fixes import doctor

    assert moe_release(moe_shape, None) == []
    assert moe_release(doctor.Shape(), "0.24.1") == []


def test_doctor_reads_the_installed_release():
    from hybrid_exl3_fixes import doctor

    assert doctor.installed_version() == (APHRODITE_VERSION if HAS_APHRODITE else None)
