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
python -m pip install -q --upgrade pip setuptools wheel 2>&1 | grep -v "^WARNING: Location" || true
python -m pip install -q -r ci/requirements-cpu.txt 2>&1 | grep -v "^WARNING: Location" || true
python -c "import torch, transformers, pytest" || { echo "setup: dependencies failed to install" >&2; exit 1; }
python -m pip install -q --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Location" || true
python -c "import hybrid_exl3_fixes" || { echo "setup: the project failed to install" >&2; exit 1; }
bash ci/aphrodite-versions.sh
bash ci/exllamav3-source.sh
echo "setup: ready (.venv, aphrodite-engine $(ls .cache/aphrodite | tr '\n' ' '))"
