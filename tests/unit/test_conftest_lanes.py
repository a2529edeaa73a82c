"""The files tests/conftest.py runs once (in the lane without aphrodite) must not depend on the release: none of
them imports aphrodite, asks which release is there, or lets doctor consult the overlay's patch status."""

from __future__ import annotations

import re

import pytest

from helpers import ROOT, VERSION_INDEPENDENT

TEST_FOLDERS = ("unit", "bench", "ci", "upstream")  # the folders ci/test.sh collects


def listed_file(name: str):
    """The one test file of that name in the folders ci/test.sh collects (conftest skips by file name)."""
    found = [ROOT / "tests" / f / name for f in TEST_FOLDERS if (ROOT / "tests" / f / name).is_file()]
    assert len(found) == 1, f"{name} is listed in VERSION_INDEPENDENT but is in {len(found)} test folders"
    return found[0]


RELEASE_DEPENDENT = re.compile(
    r"^\s*(import aphrodite|from aphrodite)|needs_aphrodite|needs_buggy|needs_fixed|HAS_APHRODITE|APHRODITE_VERSION"
    r"|aphrodite_site|aphrodite_copy|apply_all|check_overlay=True|find_spec\(.aphrodite",
    re.MULTILINE,
)


@pytest.mark.parametrize("name", VERSION_INDEPENDENT)
def test_a_file_run_once_reads_no_release(name):
    found = RELEASE_DEPENDENT.findall(listed_file(name).read_text())
    assert not found, f"{name} depends on the installed aphrodite ({found}): it must run in every lane"


def test_doctor_is_called_without_the_overlay_in_the_files_run_once():
    for name in VERSION_INDEPENDENT:
        text = listed_file(name).read_text()
        for call in re.findall(r"diagnose\([^)]*\)", text):
            assert "check_overlay=False" in call, (
                f"{name}: {call} consults the overlay (its status depends on the release)"
            )
