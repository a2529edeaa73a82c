"""Issue 9, part 4: build exllamav3's CUDA extension the way ``import exllamav3`` does (torch's
cpp_extension JIT) for one architecture, and time it. Run on the GPU machine:

    TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/exl3-ext \\
        python3 ci/exllamav3-build.py EXLLAMAV3_WHEEL [--status]

The package's ``__init__`` imports the whole library (and dependencies the GPU image lacks), so
only ``exllamav3.ext`` is imported, under a bare package object. ``--status`` reports a build in
progress from ninja's log instead (edges done of edges planned, seconds so far).
"""

from __future__ import annotations

import glob
import importlib
import os
import sys
import time
import types
import zipfile
from pathlib import Path


def status(ext_dir: Path) -> str:
    ninja = glob.glob(str(ext_dir / "**" / "build.ninja"), recursive=True)
    if not ninja:
        return "no build started"
    build = Path(ninja[0]).parent
    planned = sum(1 for line in Path(ninja[0]).read_text().splitlines() if line.startswith("build ") and ".o:" in line)
    log = build / ".ninja_log"
    done = [line.split("\t") for line in log.read_text().splitlines()[1:]] if log.exists() else []
    last_ms = max((int(d[1]) for d in done), default=0)
    so = list(build.glob("*.so"))
    return f"{build}: {len(done)} of {planned} objects compiled, {last_ms / 1000:.0f} s of ninja time" + (
        f"; built {so[0].name} ({so[0].stat().st_size / 2**20:.0f} MiB)" if so else ""
    )


def main() -> None:
    wheel, ext_dir = sys.argv[1], Path(os.environ.get("TORCH_EXTENSIONS_DIR", "/tmp/exl3-ext"))
    if "--status" in sys.argv:
        print(status(ext_dir))
        return
    src = Path("/tmp/exllamav3-src")
    if not (src / "exllamav3").is_dir():
        with zipfile.ZipFile(wheel) as z:
            z.extractall(src)
    pkg = types.ModuleType("exllamav3")
    pkg.__path__ = [str(src / "exllamav3")]
    sys.modules["exllamav3"] = pkg
    print(
        f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')} MAX_JOBS={os.environ.get('MAX_JOBS')} "
        f"cores={os.cpu_count()}",
        flush=True,
    )
    start = time.time()
    importlib.import_module("exllamav3.ext")
    print(f"exllamav3_ext built and loaded in {time.time() - start:.0f} s", flush=True)
    print(status(ext_dir))


if __name__ == "__main__":
    main()
