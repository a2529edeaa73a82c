#!/usr/bin/env bash
# exllamav3's Python and CUDA sources (its package is imported only with the compiled extension
# left out), for the tests that derive the EXL3 checkpoint layout from the format owner's code:
# .cache/exllamav3/<version>/exllamav3/...
set -euo pipefail
cd "$(dirname "$0")/.."
VER="${EXLLAMAV3_VERSION:-1.6.5}"
dest=.cache/exllamav3/$VER
[ -f "$dest/.ok2" ] && exit 0
mkdir -p .cache/wheels "$dest"
ls .cache/wheels/exllamav3-"$VER"-*.whl >/dev/null 2>&1 ||
  python ci/fetch-wheel.py exllamav3 "$VER" .cache/wheels >/dev/null ||
  python -m pip download -q --no-deps --retries 10 -d .cache/wheels "exllamav3==$VER" 2>&1 | grep -v "^WARNING: Location" || true
python - "$dest" .cache/wheels/exllamav3-"$VER"-*.whl <<'PY'
import sys, zipfile
dest, whl = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    z.extractall(dest, [n for n in z.namelist() if n.endswith((".py", ".cu", ".cuh", ".h"))])
PY
touch "$dest/.ok2"
echo "exllamav3 $VER sources in $dest"
