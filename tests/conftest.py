"""Fixtures for every test folder; plain helpers live in helpers.py."""

from __future__ import annotations

import shutil

import pytest

from helpers import aphrodite_site


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
    shutil.copytree(site / "aphrodite", dest / "aphrodite", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for info in site.glob("aphrodite_engine-*.dist-info"):
        shutil.copytree(info, dest / info.name)
    return dest
