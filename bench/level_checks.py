"""What bench/same_run.py checks before it reports a measured level, and why a level is refused.

A level of N requests is reported only when the engine served N at once, token by token, with nothing else
happening inside it:

- every request completed, and all N streamed at one moment (level_figures ``active``); for exllamav3 also the
  generator's own count of active jobs (``active_jobs``, exllamav3_generator.run_level) and each job's tokens;
- aphrodite streamed one chunk a token (``chunks_min`` == ``chunks_max`` == output), so that a token's time is the
  moment it reached the client; with speculative decoding (a step's tokens in one chunk) every request made
  ``output`` tokens by the engine's own usage count;
- the engine preempted no request (aphrodite's ``aphrodite:num_preemptions`` counter, read before and after);
- nothing was compiled inside the level's wall-clock window: no file appeared in a compile cache (Triton, Inductor,
  FlashInfer's JIT, aphrodite's torch.compile cache) and the engine logged no ``Triton kernel JIT compilation during
  inference`` warning (aphrodite 0.24's kernel JIT monitor) while it ran. The engines not being measured are
  stopped meanwhile (bench/pause.py), so whatever appears inside a window is the measured engine's.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

# aphrodite 0.24.1 (its kernel JIT monitor, mode=warn): "WARN 05:10:09 Triton kernel JIT compilation during
# inference: _gumbel_sample_kernel. This causes a latency spike; ..."
JIT_WARNING = re.compile(r"(\d\d:\d\d:\d\d) Triton kernel JIT compilation during inference: (\S+?)\.?\s")
PREEMPTIONS = re.compile(r"^aphrodite:num_preemptions(?:_total)?(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)


def refusals(row: dict, output: int, exllamav3: bool, speculative: bool = False) -> list[str]:
    """Why ``row`` (one measured level) cannot be reported; empty when it can. A ``speculative`` aphrodite variant
    streams a step's accepted tokens in one chunk: its requests must make ``output`` tokens by the engine's own
    count (usage) in at most that many chunks."""
    n, why = row.get("concurrency", 0), []
    if row.get("completed", 0) < n:
        why.append(f"{row.get('completed', 0)} of {n} requests completed")
    if row.get("active", 0) < n:
        why.append(f"at most {row.get('active', 0)} of {n} requests streamed at once")
    if exllamav3:
        if row.get("active_jobs", n) < n:
            why.append(f"at most {row['active_jobs']} of {n} jobs active in the generator")
        if row.get("completed") and (row.get("tokens_min"), row.get("tokens_max")) != (output, output):
            why.append(f"jobs made {row.get('tokens_min')}-{row.get('tokens_max')} tokens, not {output}")
    elif speculative and row.get("completed"):
        if (row.get("tokens_min"), row.get("tokens_max")) != (output, output):
            why.append(f"requests made {row.get('tokens_min')}-{row.get('tokens_max')} tokens, not {output}")
        if not 0 < row.get("chunks_min", 0) <= row.get("chunks_max", 0) <= output:
            why.append(f"streamed {row.get('chunks_min')}-{row.get('chunks_max')} chunks a request for {output} tokens")
    elif row.get("completed") and (row.get("chunks_min"), row.get("chunks_max")) != (output, output):
        chunks = f"{row.get('chunks_min')}-{row.get('chunks_max')}"
        why.append(f"streamed {chunks} chunks a request, not one a token ({output})")
    if row.get("preemptions"):
        why.append(f"{row['preemptions']:g} preemptions")
    why += [f"compiled inside: {c}" for c in row.get("compiled", [])]
    return why


def preemptions(metrics: str) -> float | None:
    """aphrodite's preemption counter from a /metrics page (summed over engines), None where it has none."""
    found = PREEMPTIONS.findall(metrics)
    return sum(float(v) for v in found) if found else None


def spec_counters(metrics: str) -> dict:
    """aphrodite's speculative-decoding counters from a /metrics page (v1/spec_decode/metrics.py, summed over
    engines): ``drafts``, ``draft_tokens``, ``accepted_tokens`` and ``per_pos`` (accepted tokens per draft position);
    empty without speculative decoding."""
    found: dict = {}
    for line in metrics.splitlines():
        if not line.startswith("aphrodite:spec_decode_num_"):
            continue
        name, _, value = line.rpartition(" ")
        key = name.split("{")[0].removeprefix("aphrodite:spec_decode_num_").removesuffix("_total")
        if key == "accepted_tokens_per_pos":
            pos = int(name.split('position="')[1].split('"')[0])
            per_pos = found.setdefault("per_pos", {})
            per_pos[pos] = per_pos.get(pos, 0.0) + float(value)
        elif not key.endswith("_created"):
            found[key] = found.get(key, 0.0) + float(value)
    return found


def spec_figures(before: dict, after: dict) -> dict | None:
    """One level's speculative figures from the counters before and after it: drafts (steps that drafted), draft
    tokens, accepted tokens, ``draft_acceptance`` (accepted / draft tokens), ``mean_accepted`` (accepted tokens a
    drafting step) and ``per_position`` (accepted at each draft position / drafts)."""
    drafts = after.get("drafts", 0) - before.get("drafts", 0)
    if not after or drafts <= 0:
        return None
    tokens = after.get("draft_tokens", 0) - before.get("draft_tokens", 0)
    accepted = after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0)
    was, now = before.get("per_pos", {}), after.get("per_pos", {})
    return {
        "drafts": drafts,
        "draft_tokens": tokens,
        "accepted_tokens": accepted,
        "draft_acceptance": round(accepted / tokens, 4) if tokens else None,
        "mean_accepted": round(accepted / drafts, 4),
        "per_position": [round((now.get(j, 0) - was.get(j, 0)) / drafts, 4) for j in sorted(now)],
    }


def jit_warnings(log: str) -> list[tuple[str, str]]:
    """(local time of day HH:MM:SS, kernel) of every compile warning aphrodite's kernel JIT monitor logged."""
    return JIT_WARNING.findall(log)


def time_of_day(epoch: float) -> str:
    """Local HH:MM:SS, as aphrodite's logger stamps its lines on the same machine."""
    return time.strftime("%H:%M:%S", time.localtime(epoch))


def in_window(tod: str, row: dict) -> bool:
    """Whether a log line's time of day falls inside the row's window, its first and last second included (the log
    has whole seconds: a line in the second a level starts or ends counts against it). Windows within one day."""
    return time_of_day(row["t_start"]) <= tod <= time_of_day(row["t_end"])


def new_files(folders: list[Path], since: float) -> list[tuple[float, str]]:
    """(mtime, path) of every file under ``folders`` modified at or after ``since`` (epoch seconds)."""
    out = []
    for folder in folders:
        for base, _, files in os.walk(folder):
            for f in files:
                path = os.path.join(base, f)
                try:
                    mtime = os.stat(path).st_mtime
                except OSError:
                    continue
                if mtime >= since:
                    out.append((mtime, path))
    return sorted(out)


def attribute_compiles(rows: list[dict], files: list[tuple[float, str]], logs: dict[str, str]) -> list[dict]:
    """Mark each measured row with what was compiled inside its window: a cache file whose mtime falls in it (else in
    the nearest window within a second: a file's time is taken after the write), or a JIT warning in the log of the
    row's own variant, which stamps whole seconds: every row of that variant whose window shares the second is
    marked. Returns every finding, also those outside any window (compiled between levels: harmless)."""
    found = []
    for mtime, path in files:
        inside = [r for r in rows if r["t_start"] <= mtime <= r["t_end"]]
        near = [r for r in rows if r["t_start"] - 1 <= mtime <= r["t_end"] + 1]
        near.sort(key=lambda r: min(abs(mtime - r["t_start"]), abs(mtime - r["t_end"])))
        row = (inside or near or [None])[0]
        found.append({"what": path, "when": round(mtime, 3), "level": _where(row)})
        if row is not None:
            row.setdefault("compiled", []).append(path)
    for variant, text in logs.items():
        for tod, kernel in jit_warnings(text):
            hit = [r for r in rows if r["variant"] == variant and in_window(tod, r)]
            found.append(
                {"what": f"{variant} JIT warning: {kernel}", "when": tod, "level": _where(hit[0] if hit else None)}
            )
            for row in hit:
                row.setdefault("compiled", []).append(f"Triton JIT of {kernel}")
    return found


def _where(row: dict | None) -> str | None:
    return None if row is None else f"{row['variant']} N={row['concurrency']} repeat {row['repeat']}"
