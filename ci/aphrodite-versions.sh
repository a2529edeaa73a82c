#!/usr/bin/env bash
# Unpack the real aphrodite-engine wheels, one folder per version, without their compiled
# extensions (they need a GPU and are 200+ MB): .cache/aphrodite/<version>/{aphrodite,*.dist-info}.
# Tests pick a version with PYTHONPATH=.cache/aphrodite/<version>; the dist-info makes
# importlib.metadata.version("aphrodite-engine") answer as for a pip install.
# The libraries that hold the EXL3 kernels go to .cache/aphrodite-kernels/<version>/aphrodite/,
# outside the importable tree, for the tests that read their kernel dispatch (P3) without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSIONS="${*:-0.20.0 0.21.0 0.22.0 0.23.0 0.24.1}"  # 0.24.0: see ci/test.sh
mkdir -p .cache/wheels .cache/aphrodite
compiled() {  # DEST: its bytecode written once (python -m compileall writes it whatever PYTHONDONTWRITEBYTECODE
  # says, which CI's image sets: without it every process the suite starts compiles aphrodite's sources again)
  [ -f "$1/.pyc-ok" ] && return
  python -m compileall -q -j 0 "$1/aphrodite" > /dev/null 2>&1 || true
  touch "$1/.pyc-ok"
}
for v in $VERSIONS; do
  dest=.cache/aphrodite/$v
  [ -f "$dest/.ok" ] && { compiled "$dest"; continue; }
  # ci/fetch-wheel.py resumes a cut download (a 290 MB wheel once failed CI at 189.5 MB); pip is the
  # fallback for an index that does not speak PEP 691's JSON.
  ls .cache/wheels/aphrodite_engine-"$v"-*.whl >/dev/null 2>&1 ||
    python ci/fetch-wheel.py aphrodite-engine "$v" .cache/wheels >/dev/null ||
    python -m pip download -q --no-deps --retries 10 -d .cache/wheels "aphrodite-engine==$v"
  rm -rf "$dest" ".cache/aphrodite-kernels/$v"; mkdir -p "$dest"
  python - "$dest" .cache/wheels/aphrodite_engine-"$v"-*.whl <<'PY'
import sys, zipfile
dest, whl = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    z.extractall(dest, [n for n in z.namelist() if not n.endswith(".so")])
    kernels = dest.replace("/aphrodite/", "/aphrodite-kernels/")
    z.extractall(kernels, [n for n in z.namelist() if n.startswith("aphrodite/_C") and n.endswith(".so")])
PY
  touch "$dest/.ok"
  compiled "$dest"
  echo "aphrodite-engine $v unpacked into $dest"
done
