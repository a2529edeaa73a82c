#!/usr/bin/env bash
# Issues 17 and 19 on one H200 (after ci/stage-0.21.sh and its install call), run detached by
# ci/device-bg.sh so it may outlast one device call. Results under /tmp/hxf-out/{moe,cal}.
#  1. the MoE server suite (tests/gpu/test_moe_server.py: each cell one `aphrodite run`, all at once),
#     while the calibration checkpoints are written on the same GPU (make-tiny --device cuda);
#  2. the memory calibration (bench/memory_calibration.py: one `aphrodite run` at a time, alone).
set -uo pipefail
cd "$(dirname "$0")/.."
SITE="${HXF_SITE:-/tmp/devsite}" ROOT=/tmp/hxf-out MODELS=/tmp/hxf-cal/models
mkdir -p "$ROOT/moe" "$ROOT/cal" "$MODELS"
export PYTHONUNBUFFERED=1 APHRODITE_NO_USAGE_STATS=1 PATH="$SITE/bin:$PATH" PYTHONPATH="$SITE"
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target "$SITE" . 2>&1 | grep -v "^WARNING: Target" | tail -3
df -h /tmp | tail -1
echo "== $(date -u +%FT%TZ) checkpoints (background) and the MoE server suite"
(
  mk() { [ -e "$MODELS/$1/manifest.json" ] || /usr/bin/time -f "make-tiny $1: %e s" python3 -m hybrid_exl3_fixes.cli make-tiny "$MODELS/$1" "${@:2}"; }
  mk 9b --preset qwen3.5-9b-full
  mk 27b4 --preset qwen3.6-27b --codebook mcg --device cuda
  mk 35b --preset qwen3.6-35b-a3b-full --bits 2
  mk 27b --preset qwen3.6-27b-full
  du -sh "$MODELS"/*; df -h /tmp | tail -1
) > "$ROOT/cal/checkpoints.log" 2>&1 &
writer=$!
TORCHINDUCTOR_COMPILE_THREADS=4 OUT="$ROOT/moe" HXF_SITE="" HXF_PYTEST_TIMEOUT="${HXF_SUITE_SECONDS:-900}" \
  bash ci/gpu.sh tests/gpu/test_moe_server.py
echo "== $(date -u +%FT%TZ) MoE suite exit $?"
wait $writer
cat "$ROOT/cal/checkpoints.log"
echo "== $(date -u +%FT%TZ) memory calibration"
python3 bench/memory_calibration.py "$MODELS" --out "$ROOT/cal" --deadline "${HXF_CAL_SECONDS:-1200}"
echo "== $(date -u +%FT%TZ) memory calibration exit $?"
tar czf "$ROOT/cal-results.tgz" -C "$ROOT/cal" .
echo "== $(date -u +%FT%TZ) done"
