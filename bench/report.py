"""What the benchmark scripts share: write a markdown table and echo it; matplotlib when present."""

from __future__ import annotations

from pathlib import Path


def write_table(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a note) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def spread(stat: dict | None) -> str:
    """A median with its spread over the repeats: ``M (MIN-MAX)``, or ``M`` when they agree, ``-`` for none."""
    if not stat or stat.get("median") is None:
        return "-"
    lo, hi = stat["min"], stat["max"]
    return f"{stat['median']} ({lo}-{hi})" if lo != hi else f"{stat['median']}"


def level_parser(doc: str, bandwidth_required: bool = True, many: bool = False):
    """The same-run reports' arguments: RUN.json (several with ``many``: the phases of one run), --inputs,
    --bandwidth-file (optional where ``bandwidth_required`` is false: a report for a GPU kind with no measured copy
    bandwidth leaves its roofline out), --out, --title, --note, --stem."""
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("run", type=Path, nargs="+" if many else None)
    p.add_argument("--inputs", type=Path, required=True)
    p.add_argument("--bandwidth-file", type=Path, required=bandwidth_required)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--title", default="")
    p.add_argument(
        "--note", action="append", default=[], help="a paragraph under the title (what the run's JSON cannot say)"
    )
    p.add_argument("--stem", default="", help="the output files' name, without suffix (default: the report's own)")
    return p


def with_notes(md: list[str], notes: list[str]) -> list[str]:
    """``md`` (a page's lines, its title and a blank line first) with each of ``notes`` as a paragraph under the
    title (``--note``)."""
    return [*md[:2], *(line for note in notes for line in (note, "")), *md[2:]]


def read_inputs(path: Path) -> dict:
    """A checkpoint's saved config and tensor list (memory_calibration.save_inputs), xz-compressed or not."""
    import json
    import lzma

    raw = path.read_bytes()
    return json.loads(lzma.decompress(raw) if path.suffix == ".xz" else raw)


def load_levels(argv: list[str] | None, doc: str, rows, bandwidth_required: bool = True) -> tuple:
    """Parse a same-run report's arguments and build its table with ``rows(run, inputs, bandwidth)``: (args, run,
    table); ``bandwidth`` is None where the report allows --bandwidth-file to be left out and it was. A missing or
    unreadable file, or a run with no measured level, ends in one argparse error line."""
    import json
    import lzma

    p = level_parser(doc, bandwidth_required)
    args = p.parse_args(argv)
    for f in (args.run, args.inputs, args.bandwidth_file):
        if f is not None and not f.is_file():
            p.error(f"{f}: no such file")
    try:
        run, inputs = json.loads(args.run.read_text()), read_inputs(args.inputs)
        bandwidth = json.loads(args.bandwidth_file.read_text())["copy_bandwidth_gbps"] if args.bandwidth_file else None
        table = rows(run, inputs, bandwidth)
    except (ValueError, KeyError, TypeError, AttributeError, lzma.LZMAError) as e:
        p.error(f"cannot read the run: {type(e).__name__}: {e}")
    if not table:
        p.error(f"{args.run}: no measured level")
    return args, run, table


def write_csv(path: Path, table: list[dict]) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)


def plot_levels(table: list[dict], path: Path, title: str, panels: list[tuple[str, str]], label=None) -> None:
    """One panel per (KEY, y label) of ``panels``: each variant's median KEY against concurrency (log 2), the
    spread KEY_min..KEY_max as error bars; ``label(name, rows)`` names a variant's line (default its name)."""
    import textwrap

    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5))
    for name in dict.fromkeys(r["variant"] for r in table):
        rs = [r for r in table if r["variant"] == name]
        n = [r["concurrency"] for r in rs]
        for ax, (key, _) in zip(axes, panels):
            med = [r[key] for r in rs]
            stem = key.removesuffix("_tok_s")  # the rows' spread: decode_tok_s -> decode_min, decode_max
            err = [[m - r[f"{stem}_min"] for m, r in zip(med, rs)], [r[f"{stem}_max"] - m for m, r in zip(med, rs)]]
            ax.errorbar(n, med, yerr=err, marker="o", capsize=3, label=label(name, rs) if label else name)
    for ax, (_, ylabel) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(title, 120)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
