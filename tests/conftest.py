"""Fixtures for every test folder; plain helpers live in helpers.py."""

from __future__ import annotations

import os
import shutil

import pytest

from helpers import HAS_APHRODITE, VERSION_INDEPENDENT, aphrodite_site


def pytest_collection_modifyitems(config, items):
    if not HAS_APHRODITE or os.environ.get("HXF_EVERY_LANE") == "1":
        return
    once = pytest.mark.skip(
        reason="version-independent (reads no aphrodite code): runs once, in the lane without aphrodite"
    )
    for item in items:
        if item.path.name in VERSION_INDEPENDENT:
            item.add_marker(once)


@pytest.fixture
def overlay():
    """The overlay with every patch undone before and after the test."""
    import hybrid_exl3_fixes

    hybrid_exl3_fixes.undo_all()
    hybrid_exl3_fixes.REGISTRY.results.clear()
    yield hybrid_exl3_fixes
    hybrid_exl3_fixes.undo_all()
    hybrid_exl3_fixes.REGISTRY.results.clear()


@pytest.fixture
def aphrodite_copy(tmp_path):
    """A private copy of the installed aphrodite sources (package + dist-info) to edit freely."""
    site = aphrodite_site()
    dest = tmp_path / "site"
    dest.mkdir()
    # without the compiled libraries and the C++/CUDA headers and web assets nothing imports (half the bytes); the
    # bytecode comes along (copytree keeps the sources' times, so an edited file's is stale and Python recompiles it)
    skipped = ("*.so", "*.h", "*.hpp", "*.cuh", "*.cu", "*.cpp", "*.js", "*.css", "*.map")
    shutil.copytree(site / "aphrodite", dest / "aphrodite", ignore=shutil.ignore_patterns(*skipped))
    for info in site.glob("aphrodite_engine-*.dist-info"):
        shutil.copytree(info, dest / info.name)
    return dest
