#!/usr/bin/env bash
# The test command (README, `make test`, .ci/run): the CPU suite against each real
# aphrodite-engine release, then once without aphrodite. Set APHRODITE_VERSIONS to narrow it.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
VERSIONS="${APHRODITE_VERSIONS:-0.20.0 0.21.0 0.24.1}"
bash ci/aphrodite-versions.sh $VERSIONS || exit 1
status=0
for v in $VERSIONS none; do
  echo "=============== aphrodite-engine: $v ==============="
  if [ "$v" = none ]; then site=""; else site="$PWD/.cache/aphrodite/$v"; fi
  PYTHONPATH="$site" "$PY" -m pytest -q -p no:cacheprovider -m "not cuda" tests/unit tests/upstream || status=1
done
exit $status
