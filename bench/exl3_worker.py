"""exllamav3's generator as one variant of bench/same_run.py: ``exllamav3_generator.py MODEL --serve`` in its own
process (its own environment: exllamav3 runs on the GPU image's torch, not the staged aphrodite's), loaded and warmed
up once, then asked one level at a time over stdin, so that its levels alternate with the aphrodite variants' in one
run. It answers with run_level's row: serving_http.level's figures by the same formula."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent


class Exl3Worker:
    def __init__(
        self, name: str, model: str, log: Path, env: dict, top: int, prompt: int, output: int, args: list[str] = ()
    ):
        self.name, self.log, self.env, self.args = name, log, env, list(args)
        self.command = [sys.executable, str(BENCH / "exllamav3_generator.py"), model, "--serve"]
        self.command += ["--concurrency", str(top), "--prompt", str(prompt), "--output", str(output), *self.args]
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue = queue.Queue()
        self.started, self.ready_s, self.ready = 0.0, None, {}

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log, "w")
        self._log.write(" ".join(self.command) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        self.started = time.monotonic()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            kind, _, payload = line.rstrip("\n").partition(" ")
            if kind in ("READY", "LEVEL", "ERROR"):
                self.lines.put((kind, payload))
        self._log.close()  # the worker has closed its stdout: nothing more comes to this handle
        self.lines.put(("EXIT", ""))

    def _next(self, deadline: float) -> tuple[str, str]:
        try:
            return self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            return "TIMEOUT", ""

    def wait_ready(self, timeout: float) -> bool:
        if self.ready:
            return True
        kind, payload = self._next(self.started + timeout)
        if kind != "READY":
            return False
        self.ready, self.ready_s = json.loads(payload), round(time.monotonic() - self.started, 1)
        return True

    def startup_figures(self) -> dict:
        keys = ("load_s", "warmup_s", "warmup_failed", "state_dtype", "cache_tokens", "max_batch_size")
        return {k: self.ready[k] for k in keys if k in self.ready}

    def warmup(self) -> dict | None:
        return self.ready.get("warmup")

    def root_error(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text.strip().splitlines()[-1] if text.strip() else ""

    def level(
        self, n: int, seed: int, output: int, timeout: float = 3600, pool: tuple[int, int] | None = None, draft: int = 0
    ) -> dict:
        """One level of ``n`` jobs on ``prompts(n, prompt, vocab, seed, pool)``, drafting ``draft`` tokens a step (a
        worker started with ``--mtp``); a worker that has died or does not answer in ``timeout`` seconds gives a row
        with every job failed."""
        failed = {"concurrency": n, "completed": 0, "failed": n}
        if self.proc is None or self.proc.poll() is not None:
            return {**failed, "first_failure": [f"the exllamav3 worker has exited: {self.root_error()[:200]}"]}
        ask = {"concurrency": n, "seed": seed, "output": output}
        ask.update({"pool": list(pool)} if pool else {}, **({"draft": draft} if draft else {}))
        try:
            self.proc.stdin.write(json.dumps(ask) + "\n")
            self.proc.stdin.flush()
        except OSError as e:  # it exited between the check and the write
            return {**failed, "first_failure": [f"the exllamav3 worker has exited: {e}"]}
        kind, payload = self._next(time.monotonic() + timeout)
        if kind == "LEVEL":
            return json.loads(payload)
        return {**failed, "first_failure": [f"{kind} {payload}"[:200]]}

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.close()  # serve() ends at end of input
        except OSError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class DraftAlias:
    """One more variant of bench/same_run.py through an Exl3Worker's process (``--exllamav3-draft``): started, paused
    and stopped with it; its levels ask for ``draft`` tokens a step."""

    def __init__(self, name: str, worker, draft: int):
        self.name, self.worker, self.draft = name, worker, draft
        self.command = [*worker.command, f"(levels drafting {draft})"]
        self.args, self.log = worker.args, worker.log

    @property
    def proc(self):
        return self.worker.proc

    @property
    def ready_s(self):
        return self.worker.ready_s

    @property
    def started(self):
        return self.worker.started

    def start(self) -> None:  # the worker starts itself
        pass

    def stop(self) -> None:
        pass

    def wait_ready(self, timeout: float) -> bool:
        return self.worker.wait_ready(timeout)

    def startup_figures(self) -> dict:
        return self.worker.startup_figures()

    def root_error(self) -> str:
        return self.worker.root_error()

    def warmup(self) -> dict | None:
        return self.worker.warmup()

    def level(self, n: int, seed: int, output: int, pool=None) -> dict:
        return self.worker.level(n, seed, output, pool=pool, draft=self.draft)
