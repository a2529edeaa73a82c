"""The files tests/conftest.py runs once (in the lane without aphrodite) must not depend on the release: none of
them imports aphrodite, asks which release is there, or lets doctor consult the overlay's patch status."""

from __future__ import annotations

import re

import pytest

from helpers import ROOT, VERSION_INDEPENDENT

RELEASE_DEPENDENT = re.compile(
    r"^\s*(import aphrodite|from aphrodite)|needs_aphrodite|needs_buggy|needs_fixed|HAS_APHRODITE|APHRODITE_VERSION"
    r"|aphrodite_site|aphrodite_copy|apply_all|check_overlay=True|find_spec\(.aphrodite",
    re.MULTILINE,
)


@pytest.mark.parametrize("name", VERSION_INDEPENDENT)
def test_a_file_run_once_reads_no_release(name):
    path = ROOT / "tests" / "unit" / name
    assert path.is_file(), f"{name} is listed in VERSION_INDEPENDENT but does not exist"
    found = RELEASE_DEPENDENT.findall(path.read_text())
    assert not found, f"{name} depends on the installed aphrodite ({found}): it must run in every lane"


def test_doctor_is_called_without_the_overlay_in_the_files_run_once():
    for name in VERSION_INDEPENDENT:
        text = (ROOT / "tests" / "unit" / name).read_text()
        for call in re.findall(r"diagnose\([^)]*\)", text):
            assert "check_overlay=False" in call, (
                f"{name}: {call} consults the overlay (its status depends on the release)"
            )
