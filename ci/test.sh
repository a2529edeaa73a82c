#!/usr/bin/env bash
# The test command (README, `make test`, .ci/run): lint and format check, the package as users get
# it (ci/package.sh), then the CPU suite against each real aphrodite-engine release the
# compatibility table names and once without aphrodite, in parallel lanes (one per core, at most
# HXF_TEST_JOBS). Set APHRODITE_VERSIONS to narrow or widen the releases.
# 0.24.0 is not a default lane: its wheel differs from 0.24.1's only in _version.py and the start-up banner
# (entrypoints/utils.py, entrypoints/serve/utils/api_utils.py; the kernel library is byte-identical), none of which a
# patch or probe reads (diff -rq of the unpacked wheels, 2026-12-01); APHRODITE_VERSIONS=0.24.0 runs it.
# Lanes are listed longest first (0.20/0.21 carry every bug) so that they finish together.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
VERSIONS="${APHRODITE_VERSIONS:-0.20.0 0.21.0 0.24.1 0.23.0 0.22.0}"
JOBS="${HXF_TEST_JOBS:-$(nproc 2>/dev/null || echo 2)}"
bash ci/aphrodite-versions.sh $VERSIONS || exit 1
status=0
started=$SECONDS

echo "=============== lint: ruff check, ruff format --check ==============="
"$PY" -m ruff check . && "$PY" -m ruff format --check . || status=1
echo "=============== package: build, twine check, clean-venv install ==============="
PYTHON="$PY" bash ci/package.sh || status=1

logs=.cache/test-logs
rm -rf "$logs"; mkdir -p "$logs"
lane() {  # one release (or none): its whole suite, output to its own log
  local v=$1 site=""
  [ "$v" = none ] || site="$PWD/.cache/aphrodite/$v"
  local t0=$SECONDS
  # one thread per lane: the lanes already fill the cores (torch's own pool would double-book them)
  PYTHONPATH="$site" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$PY" -m pytest -q -p no:cacheprovider -m "not cuda" tests/unit tests/bench tests/ci tests/upstream > "$logs/$v.log" 2>&1
  echo "$? $((SECONDS - t0))" > "$logs/$v.rc"
}
export -f lane; export PY logs
printf '%s\n' $VERSIONS none | xargs -P "$JOBS" -I{} bash -c 'lane {}'
for v in $VERSIONS none; do
  echo "=============== aphrodite-engine: $v ==============="
  cat "$logs/$v.log"
  read -r rc secs < "$logs/$v.rc" || rc=1
  [ "$rc" = 0 ] || status=1
done
echo "=============== summary ($((SECONDS - started)) s, $JOBS lanes) ==============="
for v in $VERSIONS none; do
  read -r rc secs < "$logs/$v.rc"
  printf '%-8s %s  (%s s)\n' "$v" "$(grep -E '[0-9]+ (passed|failed)' "$logs/$v.log" | tail -1)" "$secs"
done
exit $status
