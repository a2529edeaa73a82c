"""The folders make-tiny and stubs rename into place (overlay/staging.py, CPU): modes from the user's umask, an
empty target's own mode kept, and no temporary folder left by SIGTERM or SIGHUP."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid_exl3_fixes.build_stubs import cuda_prefixes, find_cuda_headers
from hybrid_exl3_fixes.checkpoint.tiny import write_staged

REAL_HEADERS = find_cuda_headers(cuda_prefixes(dict(os.environ), Path("/")), Path("/"))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def private_files(tmp: Path) -> dict:
    """What safetensors and mkdtemp do: a 0600 file, a 0700 folder."""
    (tmp / "sub").mkdir(mode=0o700)
    fd = os.open(tmp / "sub" / "model.safetensors", os.O_CREAT | os.O_WRONLY, 0o600)
    os.close(fd)
    (tmp / "config.json").write_text("{}")
    return {}


@pytest.fixture
def umask():
    """Set the process's umask for the test; the old one comes back after."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize("mask, folder, file", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640), (0o077, 0o700, 0o600)])
def test_what_is_renamed_into_place_takes_the_umask(tmp_path, umask, mask, folder, file):
    umask(mask)
    out = tmp_path / "model"
    write_staged(out, private_files)
    assert (mode(out), mode(out / "sub")) == (folder, folder)
    assert (mode(out / "config.json"), mode(out / "sub" / "model.safetensors")) == (file, file)


def test_an_empty_target_keeps_its_mode(tmp_path, umask):
    umask(0o077)
    out = tmp_path / "model"
    out.mkdir()
    out.chmod(0o755)
    write_staged(out, private_files)
    assert mode(out) == 0o755 and mode(out / "sub") == 0o700  # inside, the umask's modes


def test_make_tiny_writes_a_checkpoint_another_user_can_read(tmp_path):
    """The real make-tiny under umask 022: the folder 0755, every file 0644 (a server run as another user or in a
    container reads it)."""
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_exl3_fixes.cli", "make-tiny", str(tmp_path / "t"), "--no-dense"],
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lambda: os.umask(0o022),
    )
    assert proc.returncode == 0, proc.stderr
    paths = [tmp_path / "t", *(tmp_path / "t").rglob("*")]
    assert {p.name: mode(p) for p in paths if p.is_dir()} == {p.name: 0o755 for p in paths if p.is_dir()}
    assert {p.name: mode(p) for p in paths if p.is_file()} == {p.name: 0o644 for p in paths if p.is_file()}


def test_a_file_where_a_folder_should_be_is_named(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(FileExistsError, match=f"cannot create .*: {tmp_path / 'a-file'} is a file, not a folder"):
        write_staged(tmp_path / "a-file" / "model", private_files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


SLOW_WRITE = """
import sys, time
from pathlib import Path
from hybrid_exl3_fixes.checkpoint.tiny import write_staged

def write(tmp):
    (tmp / "half-written.safetensors").write_bytes(b"x" * 1024)
    Path(sys.argv[2]).write_text("ready")
    time.sleep(60)

write_staged(sys.argv[1], write)
"""


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the child never got to the slow step"
        time.sleep(0.05)


@pytest.mark.parametrize("signo", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_while_writing_leaves_nothing(tmp_path, signo):
    parent = tmp_path / "models"
    parent.mkdir()
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITE, str(parent / "tiny"), str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(ready, proc)
    proc.send_signal(signo)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signo
    assert list(parent.iterdir()) == []  # no hidden .tiny.* folder, no half-written target


SLOW_STUBS = """
import sys
from hybrid_exl3_fixes.build_stubs import build_stubs

build_stubs(sys.argv[1], root=sys.argv[2], env={"PATH": "/usr/bin:/bin", "CC": sys.argv[3], "CUDA_HOME": "/opt/cuda"})
"""


@pytest.mark.skipif(not REAL_HEADERS, reason="no real cuda.h here (CUDA toolkit, nvidia-cuda-runtime or triton)")
def test_a_signal_while_the_stub_compiles_leaves_nothing(tmp_path):
    """The stub generated from cuda.h by a compiler that is still running when SIGTERM comes: neither the staging
    folder nor the build/ folder the call created is left."""
    root = tmp_path / "root"
    (root / "opt/cuda/include").mkdir(parents=True)
    (root / "opt/cuda/include/cuda.h").write_bytes(Path(REAL_HEADERS[0]).read_bytes())
    ready = tmp_path / "ready"
    slow_cc = tmp_path / "slow-cc"
    slow_cc.write_text(f"#!/bin/sh\ntouch {ready}\nsleep 60\n")
    slow_cc.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_STUBS, str(work / "build" / "stubs"), str(root), str(slow_cc)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(ready, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert list(work.iterdir()) == []
