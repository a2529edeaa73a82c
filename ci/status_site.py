"""A site that holds one unpacked aphrodite-engine release as ``pip install`` would: its sources (``make install``
unpacks them under ``.cache/aphrodite/VERSION``) as links, and its compiled kernel libraries
(``.cache/aphrodite-kernels/VERSION``) beside them, which P3's and P8's probes read. ``make status RELEASE=VERSION``
and ci/readme_tables.py run ``hybrid-exl3-fixes status`` on it.

    python3 ci/status_site.py VERSION      # prints the site's path (made once, under .cache/aphrodite-status/)
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def status_site(version: str, cache: Path = ROOT / ".cache") -> Path:
    """A site that holds release ``version`` as a pip install does: its unpacked sources as links, its kernel
    libraries beside them. Made once under ``.cache/aphrodite-status/VERSION``."""
    site = cache / "aphrodite-status" / version
    sources, kernels = cache / "aphrodite" / version, cache / "aphrodite-kernels" / version / "aphrodite"
    if not sources.is_dir():
        raise SystemExit(
            f"status_site: {sources} is missing: release {version} is not unpacked here (make install unpacks "
            "0.20.0 - 0.24.1)"
        )
    libraries = sorted(kernels.glob("*.so")) if kernels.is_dir() else []
    if site.is_dir() and all((site / "aphrodite" / lib.name).exists() for lib in libraries):
        return site
    shutil.rmtree(site, ignore_errors=True)
    shutil.copytree(sources, site, copy_function=lambda src, dst: os.symlink(os.path.abspath(src), dst))
    for lib in libraries:
        os.symlink(lib.resolve(), site / "aphrodite" / lib.name)
    return site


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: python3 ci/status_site.py VERSION (a release make install unpacked: "
            f"{', '.join(sorted(p.name for p in (ROOT / '.cache' / 'aphrodite').glob('*')))})",
            file=sys.stderr,
        )
        return 2
    try:
        print(status_site(args[0]))
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
