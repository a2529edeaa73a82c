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
