"""The README stays a user's guide whose tables are the code's (ci/readme_tables.py writes them): the patch table from
the Patch records, the release matrix from each release's own status (this lane's row computed afresh, on the real
wheel), the log lines from that status. A patch added or a probe changed without ``make readme`` fails here."""

from __future__ import annotations

import sys

import pytest

from helpers import APHRODITE_VERSION, HAS_APHRODITE, ROOT

sys.path.insert(0, str(ROOT / "ci"))
import readme_tables  # noqa: E402

TEXT = (ROOT / "README.md").read_text()


def test_the_readme_is_a_guide_of_at_most_170_lines():
    assert len(TEXT.splitlines()) <= 170


def test_the_patch_table_is_the_records_and_the_matrix():
    patches = readme_tables.patches_in_id_order()
    table = readme_tables.parse_releases(TEXT)
    assert set(table) == {*readme_tables.RELEASES, readme_tables.NOT_INSTALLED}
    expected = readme_tables.render_patches(patches, table)
    assert readme_tables.block(TEXT, "patches").splitlines() == expected
    # one row of at most about 30 words a patch, each linking its section of docs/patches.md
    details = (ROOT / "docs" / "patches.md").read_text()
    for patch in patches:
        assert len(patch.symptom.split()) <= 25, patch.id
        assert f'<a id="{patch.id.lower()}"></a>' in details, patch.id


def this_lane() -> str:
    return APHRODITE_VERSION if HAS_APHRODITE else readme_tables.NOT_INSTALLED


def test_this_lanes_release_row_is_what_its_status_gives():
    """The row of the release this lane runs, computed as the generator computes it (a fresh process on a site
    with the release's kernel libraries; once more with every opt-in set)."""
    version = this_lane()
    if version not in (*readme_tables.RELEASES, readme_tables.NOT_INSTALLED):
        pytest.skip(f"aphrodite {version} has no row (0.24.0 shares 0.24.1's)")
    site = "" if version == readme_tables.NOT_INSTALLED else str(readme_tables.status_site(version))
    statuses = readme_tables.release_statuses(site)
    statuses["opted_in"] = readme_tables.release_statuses(site, opted_in=True)["patches"]
    patches = readme_tables.patches_in_id_order()
    assert readme_tables.parse_releases(TEXT)[version] == readme_tables.row(statuses, patches), (
        "stale: python3 ci/readme_tables.py --write"
    )
    if version in ("0.24.1", "0.21.0"):
        assert f"INFO ... {statuses['summary']}" in readme_tables.block(TEXT, "log-lines")


def test_a_stale_block_is_reported_and_a_missing_one_refused():
    assert readme_tables.needs({"0.20.0": "A", "0.21.0": "A", readme_tables.NOT_INSTALLED: "-"}) == "every release"
    assert readme_tables.needs({"0.20.0": "A", "0.21.0": "-", "0.22.0": "A"}) == "0.20, 0.22"
    assert readme_tables.needs({"0.20.0": "-", "0.21.0": "o", "0.22.0": "o"}) == "0.21+"
    assert readme_tables.needs({"0.20.0": "A", "0.21.0": "A", "0.22.0": "F"}) == "0.20 - 0.21"
    text = "a\n<!-- x:begin -->\nold\n<!-- x:end -->\nb\n"
    assert readme_tables.replace(text, "x", ["new"]) == "a\n<!-- x:begin -->\nnew\n<!-- x:end -->\nb\n"
    with pytest.raises(ValueError, match="no y block"):
        readme_tables.replace(text, "y", [])
