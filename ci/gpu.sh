#!/usr/bin/env bash
# The GPU suite in one call (make test-gpu; on the H200 through the device tool after
# ci/stage-0.21.sh): installs this project as a real distribution next to aphrodite,
# prints `hybrid-exl3-fixes status`, runs tests/gpu, writes the log, the JSON results and a
# markdown summary under OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
SITE="${HXF_SITE:-}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 APHRODITE_NO_USAGE_STATS=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/hxf-triton-cache}"
export HXF_GPU_WORK="${HXF_GPU_WORK:-/tmp/hxf-gpu}" HXF_GPU_RESULTS="$OUT/gpu-results.json"
# checkpoints are rebuilt by the code under test; the servers' compile caches (aphrodite-cache/CELL) are kept, so
# that caches carried from an earlier run (ci/gpu-run.sh restores them) spare the cold start
mkdir -p "$HXF_GPU_WORK"; find "$HXF_GPU_WORK" -mindepth 1 -maxdepth 1 ! -name aphrodite-cache -exec rm -rf {} +
if [ -n "$SITE" ]; then
  bash ci/site-install.sh "$SITE"
  export PYTHONPATH="$SITE"
fi
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
  python3 -c "import aphrodite, torch; print('aphrodite', aphrodite.__version__, 'torch', torch.__version__)"
  python3 -m hybrid_exl3_fixes.cli status
  [ $# -gt 0 ] || set -- tests/gpu tests/upstream  # the drop-in upstream tests include a GPU one (P3)
  # HXF_PYTEST_TIMEOUT: stop with SIGINT in time for pytest to write its report (device calls are capped)
  timeout -s INT "${HXF_PYTEST_TIMEOUT:-86400}" python3 -m pytest -v -p no:cacheprovider -o addopts="" \
    --junitxml="$OUT/gpu-junit.xml" "$@"
} 2>&1 | tee "$OUT/gpu.log"
rc=${PIPESTATUS[0]}
python3 ci/gpu_summary.py "$OUT/gpu-junit.xml" "$HXF_GPU_RESULTS" > "$OUT/gpu-results.md" || true
# the device tool brings back at most 8 files: the engine logs travel as one archive
(cd "$HXF_GPU_WORK" && tar czf "$OUT/engine-logs.tgz" ./*.log 2>/dev/null)
exit $rc
