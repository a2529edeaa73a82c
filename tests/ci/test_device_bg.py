"""ci/device-bg.sh on real processes (fake input: a job of sleeps in sessions of their own)."""

from __future__ import annotations

import shutil
import subprocess

from helpers import ROOT


def test_device_bg_stop_ends_every_process_of_the_job_whatever_its_session(tmp_path):
    """ci/device-bg.sh stop ends every process of the job, also its children in sessions of their own (an
    exllamav3 generator, servers), which a pkill on the job's script leaves running beside the next job. A job
    here: a background sleep (bash makes it ignore SIGINT) and a process in a new session."""
    import time
    import uuid

    work = tmp_path / "tree"
    (work / "ci").mkdir(parents=True)
    shutil.copy(ROOT / "ci" / "device-bg.sh", work / "ci")
    name = f"t{uuid.uuid4().hex[:8]}"
    marker = f"{name}-sleeper"
    job = f'sleep 300 & setsid python3 -c "import time; time.sleep(300)" {marker} & wait'
    run = lambda *a: subprocess.run(["bash", "ci/device-bg.sh", *a], cwd=work, capture_output=True, text=True)  # noqa: E731
    assert run("start", name, "bash", "-c", job).returncode == 0
    try:
        for _ in range(50):
            if subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        stopped = run("stop", name)
        assert stopped.returncode == 0 and f"stopped {name}" in stopped.stdout, stopped
        assert subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 1  # none left
        waited = run("wait", name, "5")
        assert waited.returncode == 0 and "exit 143" in waited.stdout  # a later wait ends at once
        assert "no job" in run("stop", f"{name}-never").stdout
    finally:
        subprocess.run(["pkill", "-f", marker])
        shutil.rmtree(f"/tmp/hxf-src-{name}", ignore_errors=True)
