"""What the commands that build a folder in a temporary sibling and rename it into place (make-tiny, stubs) share:
a termination signal becomes an ordinary exit while the temporary folder exists, so that its clean-up runs, and
what is renamed into place gets the modes the user's umask gives (``tempfile.mkdtemp`` makes its folder 0700 and
safetensors writes its files 0600, whatever the umask)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

# SIGINT already raises KeyboardInterrupt; SIGKILL cannot be caught
EXIT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextlib.contextmanager
def signals_exit() -> Iterator[None]:
    """Within the block SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` (the shell's exit status for a
    signal), so ``finally`` and ``except BaseException`` clean-ups run; the previous handlers come back after.
    Outside the main thread, where Python sets no handler, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signo, _frame):
        raise SystemExit(128 + signo)

    previous = {signo: signal.signal(signo, handler) for signo in EXIT_SIGNALS}
    try:
        yield
    finally:
        for signo, old in previous.items():
            signal.signal(signo, old)


@contextlib.contextmanager
def staged_sibling(out: Path, prefix: str, cannot_create: Callable[[OSError], Exception]) -> Iterator[Path]:
    """A new temporary folder beside ``out`` (the parents made), for the block to build in and rename into place;
    removed when the block ends, however it ends, SIGTERM and SIGHUP included (:func:`signals_exit`). A folder that
    cannot be made raises ``cannot_create(the OSError)``."""
    tmp = None
    with signals_exit():
        try:
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
            except OSError as exc:
                raise cannot_create(_file_on_the_way(out) or exc) from None
            yield tmp
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


def _file_on_the_way(out: Path) -> OSError | None:
    """The error to name where a folder above ``out`` is a file (mkdir says only "File exists")."""
    for parent in out.parents:
        if parent.exists():
            return None if parent.is_dir() else NotADirectoryError(errno.ENOTDIR, f"{parent} is a file, not a folder")
    return None


def current_umask() -> int:
    """The process's umask (Linux reads it from /proc without changing it; elsewhere it is set and put back)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: Path, umask: int | None = None) -> None:
    """Folders under and including ``root`` 0777 less the umask, files 0666 less it (none is an executable)."""
    umask = current_umask() if umask is None else umask
    os.chmod(root, 0o777 & ~umask)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o666 & ~umask)
