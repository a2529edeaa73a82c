"""Helpers of the GPU suite (imported as `harness`; kept out of conftest.py so the name is unique)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
RESULTS: dict = {}


def run_engine(case: dict, workdir: Path, name: str, env_extra: dict | None = None, timeout: int = 900) -> dict:
    """Run engine_case.py in a fresh process; returns its RESULT plus the full output."""
    case_path = workdir / f"{name}.json"
    case_path.write_text(json.dumps(case))
    env = dict(os.environ)
    env.pop("HYBRID_EXL3_FIXES_DISABLE", None)
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, str(HERE / "engine_case.py"), str(case_path)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    (workdir / f"{name}.log").write_text(output)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    result = json.loads(lines[-1][7:]) if lines else {"ok": False, "stage": "crash", "error": f"exit {proc.returncode}"}
    result["output"] = output
    return result


def compare(prompt_logprobs: list, ref) -> dict:
    """max |d logprob| over aphrodite's top-k at each prompt position, and argmax agreement."""
    max_diff, argmax_same, positions = 0.0, 0, 0
    for pos, entry in enumerate(prompt_logprobs):
        if entry is None:
            continue
        row = ref[pos - 1]
        positions += 1
        for token, lp in entry.items():
            max_diff = max(max_diff, abs(lp - float(row[int(token)])))
        best = max(entry.items(), key=lambda kv: kv[1])[0]
        argmax_same += int(int(best) == int(row.argmax()))
    return {"max_abs_dlogprob": max_diff, "argmax_agree": argmax_same, "positions": positions}
