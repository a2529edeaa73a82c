"""Stop and resume an engine's whole process tree, so that an engine not being measured takes no host or GPU time.

bench/same_run.py measures one variant at a time; the others are idle but alive (an API server's event loop, an
engine core's busy loop, compile workers), and on a shared host they take cores from the measured one. SIGSTOP
freezes every process of the tree (the root, then its descendants, found through /proc, whatever process group
or session they moved to); SIGCONT resumes them in the reverse order. A stopped process cannot act on SIGINT or
SIGTERM: resume a tree before stopping it for good.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def children_map(proc: Path = Path("/proc")) -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc/PID/stat (its fourth field; the command may hold spaces and
    parentheses, so the fields are read after its last ')')."""
    out: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        out.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return out


def tree(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """``pid`` and every descendant, parents before children."""
    kids, order, todo = children_map(proc), [], [pid]
    while todo:
        p = todo.pop(0)
        if p not in order:
            order.append(p)
            todo.extend(kids.get(p, []))
    return order


def _send(pids: list[int], sig: int) -> list[int]:
    sent = []
    for p in pids:
        try:
            os.kill(p, sig)
            sent.append(p)
        except (ProcessLookupError, PermissionError):
            pass
    return sent


def stop(pid: int) -> list[int]:
    """SIGSTOP ``pid``'s tree, the root first (so that it cannot react to a child that stops); the pids stopped."""
    return _send(tree(pid), signal.SIGSTOP)


def resume(pid: int) -> list[int]:
    """SIGCONT ``pid``'s tree, children first and the root last; the pids resumed."""
    return _send(tree(pid)[::-1], signal.SIGCONT)


def state(pid: int) -> str:
    """The process's state letter in /proc (``T``: stopped), or ``-`` once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "-"
