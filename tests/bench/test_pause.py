"""bench/pause.py on real processes (fake input: a shell that starts a child in another session)."""

from __future__ import annotations

import subprocess
import sys
import time

from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import pause  # noqa: E402


def test_a_tree_is_stopped_and_resumed_whole_even_a_child_in_its_own_session(tmp_path):
    beat = tmp_path / "beat"
    child = f"import time\nwhile True:\n    open({str(beat)!r}, 'a').write('x'); time.sleep(0.01)"
    root = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}], "
            "start_new_session=True); time.sleep(60)",
        ],
    )
    try:
        deadline = time.monotonic() + 10
        while (not beat.exists() or len(pause.tree(root.pid)) < 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = pause.tree(root.pid)
        assert len(pids) == 2 and pids[0] == root.pid
        assert pause.stop(root.pid) == pids
        time.sleep(0.1)
        assert [pause.state(p) for p in pids] == ["T", "T"]
        size = beat.stat().st_size
        time.sleep(0.2)
        assert beat.stat().st_size == size  # the child made no progress while stopped
        assert pause.resume(root.pid) == pids[::-1]
        time.sleep(0.2)
        assert beat.stat().st_size > size and "T" not in [pause.state(p) for p in pids]
    finally:
        for p in pause.tree(root.pid)[::-1]:
            subprocess.run(["kill", "-9", str(p)])
        root.wait(10)
    assert pause.state(root.pid) == "-" and pause.stop(root.pid) == []  # gone: nothing to signal
