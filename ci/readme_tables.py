"""The README's generated parts (and docs/evidence.md's MoE serving table), made from the code that decides them: the
patch table from each patch's record (``Patch.symptom``, ``Patch.opt_in``), the release matrix from each release's own
``hybrid-exl3-fixes status --json``, and the example log lines from that matrix.

    python3 ci/readme_tables.py --write   # rewrite the README's generated blocks (the releases make install unpacked)
    python3 ci/readme_tables.py --check   # exit 1 when the README's blocks are not what the code gives

Each release's status runs in a fresh process on a site like a pip install's: the release's unpacked sources
(``.cache/aphrodite/VERSION``) as links, its compiled kernel libraries (``.cache/aphrodite-kernels/VERSION``) beside
them, since P3's and P8's probes read those libraries' symbols. The blocks sit between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->`` markers; tests/unit/test_readme.py checks them in every CI lane (the release matrix's row for the
lane's own release, computed live)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from status_site import status_site  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EVIDENCE = ROOT / "docs" / "evidence.md"
# how docs/evidence.md names each kind of overlay/compat.py's MoE serving table
MOE_KINDS = {
    "compiled": "default compiled mode",
    "eager": "eager only",
    "none": "does not start",
    "not run": "not run on a GPU",
}
RELEASES = ("0.20.0", "0.21.0", "0.22.0", "0.23.0", "0.24.1")
NOT_INSTALLED = "not installed"
CODES = {
    "APPLIED": "A",
    "UPSTREAM_FIXED": "F",
    "NOT_APPLICABLE": "-",
    "DISABLED": "off",
    "DRIFTED": "DRIFTED",
    "FAILED": "FAILED",
    "BROKEN_INSTALL": "BROKEN",
}
OPT_IN = "o"
LEGEND = [
    "A: applied (the bug is there, the fix installed) · F: fixed upstream, nothing replaced · -: nothing to fix on",
    "that release · o: an opt-in, off until its variable is set (and then applied)",
]


def release_statuses(pythonpath: str, opted_in: bool = False) -> dict:
    """``status --json`` of the release on ``pythonpath`` ("" for none), in a fresh process, with every opt-in on
    where ``opted_in``: {id: (status, reason)} and the summary line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRID_EXL3_FIXES_")}
    env.update(PYTHONPATH=pythonpath, APHRODITE_LOGGING_LEVEL="ERROR")
    if opted_in:
        env.update({p.opt_in: "1" for p in patches_in_id_order() if p.opt_in})
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_exl3_fixes.cli", "status", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    report = json.loads(proc.stdout)
    return {"patches": {p["id"]: (p["status"], p["reason"]) for p in report["patches"]}, "summary": report["summary"]}


def row(statuses: dict, patches) -> list[str]:
    """One release's cells, in patch order: the status's code; for an opt-in left off, what it does when opted in
    (``o`` where it would apply)."""
    cells = []
    for patch in patches:
        status, reason = statuses["patches"][patch.id]
        if patch.opt_in and status == "NOT_APPLICABLE" and patch.opt_in in reason:
            opted = statuses["opted_in"][patch.id][0]
            cells.append(OPT_IN if opted == "APPLIED" else CODES[opted])
        else:
            cells.append(CODES[status])
    return cells


def patches_in_id_order():
    import hybrid_exl3_fixes
    from hybrid_exl3_fixes.registry import patch_number

    return sorted(hybrid_exl3_fixes.PATCHES, key=lambda p: patch_number(p.id))


def matrix(releases=RELEASES) -> dict[str, dict]:
    """{release: statuses} for every release of ``releases`` and for none installed."""
    out = {}
    for version, site in [*((v, str(status_site(v))) for v in releases), (NOT_INSTALLED, "")]:
        out[version] = release_statuses(site)
        out[version]["opted_in"] = release_statuses(site, opted_in=True)["patches"]
    return out


def short(version: str) -> str:
    return ".".join(version.split(".")[:2])


def needs(cells_by_release: dict[str, str]) -> str:
    """Where a patch applies (or waits for its opt-in), as a range: ``every release``, ``0.23+``, ``0.20 - 0.21``."""
    order = [v for v in cells_by_release if v != NOT_INSTALLED]
    on = [v for v in order if cells_by_release[v] in ("A", OPT_IN)]
    if not on:
        return "none of the tested releases"
    if on == order:
        return "every release"
    first, last = order.index(on[0]), order.index(on[-1])
    if on != order[first : last + 1]:
        return ", ".join(short(v) for v in on)
    if last == len(order) - 1:
        return f"{short(on[0])}+"
    return short(on[0]) if first == last else f"{short(on[0])} - {short(on[-1])}"


def render_patches(patches, table: dict[str, list[str]]) -> list[str]:
    """The patch table: id, symptom, the releases that need it (from the matrix), opt-in, its page."""
    lines = ["| patch | without it | needs it | more |", "|---|---|---|---|"]
    for i, patch in enumerate(patches):
        where = needs({v: cells[i] for v, cells in table.items()})
        if patch.opt_in:
            where += f", opt-in: `{patch.opt_in}=1`"
        lines.append(f"| {patch.id} | {patch.symptom} | {where} | [{patch.id}](docs/patches.md#{patch.id.lower()}) |")
    return lines


def render_releases(patches, table: dict[str, list[str]]) -> list[str]:
    lines = ["| release | " + " | ".join(p.id for p in patches) + " |", "|---" * (len(patches) + 1) + "|"]
    for version, cells in table.items():
        lines.append(f"| {version} | " + " | ".join(cells) + " |")
    return lines + ["", *LEGEND]


def render_log_lines(found: dict[str, dict]) -> list[str]:
    """The summary line each engine process logs, as the status of 0.24.1 and 0.21.0 gives it."""
    return ["```", *(f"INFO ... {found[v]['summary']}" for v in ("0.24.1", "0.21.0") if v in found), "```"]


def blocks(found: dict[str, dict]) -> dict[str, list[str]]:
    patches = patches_in_id_order()
    table = {v: row(s, patches) for v, s in found.items()}
    return {
        "patches": render_patches(patches, table),
        "releases": render_releases(patches, table),
        "log-lines": render_log_lines(found),
    }


def render_moe_serving() -> list[str]:
    """Where an EXL3 MoE hybrid serves with the overlay, per release (overlay/compat.py, which doctor reads too)."""
    from hybrid_exl3_fixes.compat import MOE_SERVING

    lines = ["| release | EXL3 MoE with the overlay | evidence |", "|---|---|---|"]
    for version, entry in MOE_SERVING.items():
        lines.append(f"| {version} | {MOE_KINDS[entry.kind]} | {entry.evidence} |")
    return lines


def block(text: str, name: str) -> str:
    """The content between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``; ValueError where the markers are not."""
    match = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", text, re.S)
    if match is None:
        raise ValueError(f"README.md has no {name} block")
    return match.group(1)


def replace(text: str, name: str, lines: list[str]) -> str:
    """``text`` with block NAME's content replaced by ``lines``."""
    old = block(text, name)
    start = text.index(f"<!-- {name}:begin -->\n") + len(f"<!-- {name}:begin -->\n")
    return text[:start] + "\n".join(lines) + "\n" + text[start + len(old) :]


def parse_releases(text: str) -> dict[str, list[str]]:
    """The release matrix as the README has it: {release: cells}."""
    rows = [line for line in block(text, "releases").splitlines() if line.startswith("| ")][1:]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in rows)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the README's generated blocks")
    mode.add_argument("--check", action="store_true", help="exit 1 when the README's blocks are stale")
    args = p.parse_args(argv)
    pages = {README: blocks(matrix()), EVIDENCE: {"moe-serving": render_moe_serving()}}
    stale = []
    for page, generated in pages.items():
        text = page.read_text()
        new = text
        for name, lines in generated.items():
            new = replace(new, name, lines)
        if new != text:
            stale.append(page)
            if args.write:
                page.write_text(new)
    names = ", ".join(str(p.relative_to(ROOT)) for p in stale) or "none"
    if args.write:
        print(f"generated blocks rewritten in: {names}")
        return 0
    if stale:
        print(f"stale generated blocks in {names}: python3 ci/readme_tables.py --write", file=sys.stderr)
        return 1
    print("generated blocks current")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
