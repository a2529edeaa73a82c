"""The real `aphrodite run` server of the installed aphrodite, started as a user starts it.

One :class:`Server` is one process group: ``aphrodite run MODEL --port P ...`` with its output in
``LOG``, reached only over HTTP. The overlay reaches it the way it reaches a user's server: as an
installed distribution whose ``aphrodite.general_plugins`` entry point aphrodite's own loader finds
(ci/gpu.sh installs it next to aphrodite); nothing here imports it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from serving import root_cause  # noqa: E402  (bench/serving.py: the engine core's own error in a log)

OVERLAY_LINE = re.compile(r"hybrid-exl3-fixes: (applied=\d+ upstream_fixed=\d+ drifted=\d+[^\n]*)")
# startup figures the engine logs (bench/memory_plan_report.py compares doctor's plan with them)
STARTUP_FIGURES = {
    "available_kv_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
    "kv_cache_tokens": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
    "max_concurrency": re.compile(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x"),
    "torch_compile_s": re.compile(r"torch\.compile took ([\d.]+) s in total"),
    "attention_block_size": re.compile(r"Setting attention block size to (\d+) tokens"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
    "weights_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "kv_reserved_gib": re.compile(r"reserved ([\d.]+) GiB memory for KV Cache"),
}


def _default_sigint() -> None:
    """In the server's process before exec: SIGINT back to its default. Started from a background job (the
    device scripts start drivers with &), a process inherits SIGINT ignored from bash, and stop()'s SIGINT then
    waits its 30 s for nothing before SIGKILL (aphrodite installs its own handler; a plain program does not)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def aphrodite_command() -> list[str]:
    """The user's command: ``aphrodite`` on PATH (the console script), else the same entry point."""
    found = shutil.which("aphrodite")
    return [found] if found else [sys.executable, "-m", "aphrodite.entrypoints.cli.main"]


@dataclass
class Server:
    name: str
    model: str
    args: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    started: float = 0.0
    ready_s: float | None = None
    exe: list[str] = field(default_factory=list)  # the console script to run; empty: aphrodite_command()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        return [
            *(self.exe or aphrodite_command()),
            "run",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "HYBRID_EXL3_FIXES_DISABLE"}
        env.update(self.env)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as out:
            out.write(" ".join(self.command) + "\n")
            out.flush()
            # its own process group: stop() ends the API server, the engine core and their children
            self.proc = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_default_sigint,
            )
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float) -> bool:
        """Poll /health until it answers 200 (True), the process exits or the timeout passes (False)."""
        import httpx

        # the deadline counts from the start; a server asked after it has passed is still asked once (run 11:
        # cells started together were judged "not started" unasked after the first cell's wait had used it up)
        deadline = self.started + timeout
        while True:
            if not self.alive():
                return False
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    self.ready_s = self.ready_s or round(time.monotonic() - self.started, 1)
                    return True
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(2)

    def healthy(self) -> bool:
        import httpx

        try:
            return self.alive() and httpx.get(self.url + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def root_error(self) -> str:
        return root_cause(self.text())

    def overlay_lines(self) -> list[str]:
        return OVERLAY_LINE.findall(self.text())

    def startup_figures(self) -> dict:
        text, found = self.text(), {}
        for key, pattern in STARTUP_FIGURES.items():
            match = pattern.search(text)
            if match:
                found[key] = float(match.group(1).replace(",", ""))
        return found
