"""ci/devstage-resplit.sh: ci/stage-0.21.sh's parts re-split to fit one device call beside the tracked tree (64 MiB
in all). Fake input: a .devstage/ of random parts in a scratch git repo."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from helpers import ROOT

MIB = 1 << 20
INSTALL = '[ "$have" -eq 3 ] || { echo "devstage: $have of 3 parts on this machine"; exit 3; }\n'


def stage(tmp_path, sizes):
    repo = tmp_path / "repo"
    (repo / "ci").mkdir(parents=True)
    shutil.copy(ROOT / "ci" / "devstage-resplit.sh", repo / "ci")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    payload = os.urandom(sum(sizes))
    start = 0
    for n, size in enumerate(sizes, 1):
        (repo / ".devstage" / str(n)).mkdir(parents=True)
        (repo / ".devstage" / str(n) / "chunk").write_bytes(payload[start : start + size])
        start += size
    (repo / ".devstage" / "install").mkdir()
    (repo / ".devstage" / "install" / "install.sh").write_text("#!/usr/bin/env bash\n" + INSTALL)
    return repo, payload


def resplit(repo, *args):
    return subprocess.run(
        ["bash", "ci/devstage-resplit.sh", *args], cwd=repo, capture_output=True, text=True, timeout=60
    )


def test_the_parts_are_re_split_with_the_payload_and_the_scripts_to_match(tmp_path):
    repo, payload = stage(tmp_path, [int(1.5 * MIB)] * 3)
    proc = resplit(repo, "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 parts -> 5 parts of <= 1 MiB (payload unchanged)" in proc.stdout
    parts = sorted((p for p in (repo / ".devstage").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    assert [p.name for p in parts] == ["1", "2", "3", "4", "5"]
    assert all((p / "chunk").stat().st_size <= MIB for p in parts)
    assert b"".join((p / "chunk").read_bytes() for p in parts) == payload
    assert "/tmp/devstage/part5;" in (parts[4] / "stash.sh").read_text()
    install = (repo / ".devstage" / "install" / "install.sh").read_text()
    assert "-eq 5 ]" in install and "of 5 parts" in install


@pytest.mark.parametrize("missing", ["parts", "install"])
def test_without_a_staged_folder_it_says_what_to_run_and_changes_nothing(tmp_path, missing):
    repo, _ = stage(tmp_path, [MIB])
    if missing == "parts":
        shutil.rmtree(repo / ".devstage" / "1")
    else:
        shutil.rmtree(repo / ".devstage" / "install")
    before = sorted(str(p.relative_to(repo)) for p in (repo / ".devstage").rglob("*"))
    proc = resplit(repo)
    assert proc.returncode == 2 and "run ci/stage-0.21.sh first" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(str(p.relative_to(repo)) for p in (repo / ".devstage").rglob("*")) == before


def test_the_tracked_tree_and_one_staging_part_fit_one_device_call():
    """A device call carries the working tree and what it names, 64 MiB in all; a staging call carries one part of
    ci/stage-0.24.sh's 52 MiB: a run's logs are committed compressed (docs/development.md)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    tree = sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())
    part = 52 * MIB
    assert "PART_BYTES=$((52 * 1024 * 1024))" in (ROOT / "ci" / "stage-0.24.sh").read_text()
    assert tree + part < 64 * MIB - 256 * 1024, f"tracked tree {tree / MIB:.1f} MiB + a {part // MIB} MiB part"
