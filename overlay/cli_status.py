"""``hybrid-exl3-fixes status``: what each patch does in the installed aphrodite, as aphrodite's own plugin loader
applies it; a table that fits in 120 columns (the reason and upstream wrapped under each patch), or ``--json``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import textwrap

from .registry import patch_number

EXIT_OK, EXIT_DRIFTED, EXIT_NOT_LOADED, EXIT_BROKEN_INSTALL = 0, 1, 2, 3
MAX_WIDTH = 120  # the table's width where the terminal is wider or unknown (a pipe, a log)
MIN_WIDTH = 80


def table_width() -> int:
    return max(MIN_WIDTH, min(MAX_WIDTH, shutil.get_terminal_size((MAX_WIDTH, 24)).columns))


def wrap(text: str, width: int, indent: str = "") -> list[str]:
    """``text`` in lines of at most ``width`` characters; paths and URLs are kept whole where they fit a line."""
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False) or [
        indent.rstrip()
    ]


def render_table(results: list, width: int) -> list[str]:
    """One row per patch (id and slug, status, the release that fixed it), its reason and its upstream reference
    wrapped in the last column: every line at most ``width`` characters."""
    rows = [("patch", "status", "fixed in")]
    rows += [(f"{r.patch.id} {r.patch.slug}", r.status.value, r.patch.fixed_in or "-") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    left = sum(widths) + 2 * 3
    texts = [(r.reason, f"upstream: {r.patch.upstream}") for r in results]
    longest = max((len(word) for pair in texts for text in pair for word in text.split()), default=0)
    # beside the row where the column holds 40 characters and the longest path; else under it, indented by 4
    beside = width - left >= max(40, longest)
    text_width = width - left if beside else width - 4
    indent = " " * (left if beside else 4)
    lines = [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(rows[0])) + ("  reason; upstream" if beside else "")
    ]
    for row, (reason, upstream) in zip(rows[1:], texts):
        head = "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)) + "  "
        body = wrap(reason, text_width) + wrap(upstream, text_width)
        if beside:
            lines.append(head + body.pop(0))
        else:
            lines.append(head)
        lines += [indent + part for part in body]
    return [line.rstrip() for line in lines]


def cmd_status(args: argparse.Namespace) -> int:
    # quiet unless something is wrong: aphrodite's import-time INFO/WARNING lines (no libcuda on a CPU machine,
    # Triton without a driver, UCX settings) say nothing about the patches; the table says what matters. A
    # logging level the user set is kept.
    os.environ.setdefault("APHRODITE_LOGGING_LEVEL", "ERROR")
    import hybrid_exl3_fixes as overlay

    gate = overlay.plugin_gate()
    loaded_by_aphrodite = False
    try:
        from aphrodite.plugins import load_general_plugins
    except ImportError:
        load_general_plugins = None
    except Exception as exc:  # an aphrodite that fails to import is reported, not raised
        print(f"hybrid-exl3-fixes: importing aphrodite.plugins failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        load_general_plugins = None
    if load_general_plugins is not None and gate is None:
        # The real path: aphrodite's own loader finds the entry point and calls register().
        load_general_plugins()
        loaded_by_aphrodite = len(overlay.REGISTRY.results) == len(overlay.PATCHES)
    results = sorted(overlay.status(), key=lambda r: patch_number(r.patch.id))  # applies here when aphrodite did not

    broken = [r for r in results if r.status is overlay.Status.BROKEN_INSTALL]
    drifted = any(r.is_problem for r in results)
    not_loaded = load_general_plugins is not None and gate is not None
    switch = overlay.off_switch_warning()
    if args.json:
        report = {
            "aphrodite": overlay.aphrodite_version(),
            "loaded_by_aphrodite": loaded_by_aphrodite,
            "plugin_gate": gate,
            "off_switch_unknown": overlay.REGISTRY.unknown_disabled(),
            "summary": overlay.summary(results),
            "patches": [r.as_dict() for r in results],
        }
        print(json.dumps(report, indent=2), file=args.json_out)
    else:
        width = table_width()
        notes = []
        if any(r.patch.upstream.startswith(("docs/", "not reported yet (patches/")) for r in results):
            notes.append(
                "(docs/upstream/... and patches/... are files of the hybrid-exl3-fixes source repository, "
                "not of the installed package)"
            )
        if not_loaded:
            notes.append(f"WARNING: aphrodite will not load the overlay: {gate}. The table shows what it would do.")
        if broken:
            notes.append(f"ERROR: the aphrodite install is broken, not the patches: {broken[0].reason}")
        if switch:
            notes.append(f"WARNING: {switch}.")
        else:
            ids = ",".join(sorted((p.id for p in overlay.PATCHES), key=patch_number))
            notes.append(f"Off switch: {overlay.DISABLE_ENV}=1 (all) or ={ids} (some).")
        lines = render_table(results, width) + wrap(overlay.summary(results), width)
        for note in notes:
            lines += wrap(note, width)
        print("\n".join(lines))
    if broken:
        return EXIT_BROKEN_INSTALL
    if drifted:
        return EXIT_DRIFTED
    if not_loaded:
        return EXIT_NOT_LOADED
    return EXIT_DRIFTED if switch else EXIT_OK
