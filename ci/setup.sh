#!/usr/bin/env bash
# Set up a fresh machine for the CPU suite: a virtualenv at .venv with torch (CPU, from the local
# disk where the machine has it), the pure-Python dependencies aphrodite's modules need to import,
# the project itself (editable, so its entry points are real metadata), and the three aphrodite
# releases unpacked under .cache/aphrodite. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYBIN="${PYBIN:-python3}"
[ -x .venv/bin/python ] || "$PYBIN" -m venv .venv
. .venv/bin/activate
# A dropped connection is retried (pip resumes a cut download; a failed install runs again, up to
# three times), so that a network hiccup does not fail the CI run; the import checks decide.
pip_retry() {
  local i rc out resume=()
  python -m pip install --help 2>/dev/null | grep -q -- --resume-retries && resume=(--resume-retries 20)
  for i in 1 2 3; do
    out=$(python -m pip install -q --retries 10 "${resume[@]}" "$@" 2>&1) && rc=0 || rc=$?
    # quiet unless something is wrong: a successful install's warnings (setuptools' deprecation notices for the
    # license table that older build backends need) are not shown
    [ "$rc" = 0 ] && return 0
    printf '%s\n' "$out" | grep -v -e "^WARNING: Location" -e '^$' >&2 || true
    echo "setup: pip install $* failed with status $rc (try $i of 3)" >&2
    [ "$i" = 3 ] || sleep $((i * 10))
  done
  return 0
}
pip_retry --upgrade pip setuptools wheel
pip_retry -r ci/requirements-cpu.txt
python -c "import torch, transformers, pytest" || { echo "setup: dependencies failed to install" >&2; exit 1; }
pip_retry --no-build-isolation -e .
python -c "import hybrid_exl3_fixes" || { echo "setup: the project failed to install" >&2; exit 1; }
bash ci/aphrodite-versions.sh
bash ci/exllamav3-source.sh
echo "setup: ready (.venv, aphrodite-engine $(ls .cache/aphrodite | tr '\n' ' '))"
