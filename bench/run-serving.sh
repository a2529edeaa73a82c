#!/usr/bin/env bash
# Issue 7 on one GPU (the H200 through the device tool, after ci/stage-0.21.sh):
#   OUT=DIR HXF_SITE=/tmp/devsite bash bench/run-serving.sh SECONDS [serving.py options]
# installs the overlay as a distribution next to aphrodite in HXF_SITE, writes the four 27B-width
# checkpoints once (make-tiny --device cuda; only mcg keeps its dense twin), runs or resumes
# bench/serving.py with a deadline (a device call is capped at 10 minutes; finished engines are
# skipped on the next call), and bundles results and engine logs into OUT/serving-results.tgz.
# HXF_CODEBOOKS="mcg" writes only those checkpoints (the chunk, graphs and LoRA experiments need
# only mcg; the default writes all four).
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET="${1:?seconds this script may run (no engine starts after that)}"; shift
OUT="${OUT:-$PWD/out}" SITE="${HXF_SITE:?folder holding aphrodite}" WORK="${HXF_BENCH_WORK:-/tmp/hxf-bench}"
mkdir -p "$OUT" "$WORK/models"
export PYTHONUNBUFFERED=1 APHRODITE_NO_USAGE_STATS=1 PYTHONPATH="$SITE"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/hxf-triton-cache}"
bash ci/site-install.sh "$SITE"
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
  for cb in ${HXF_CODEBOOKS:-mcg mixed 3inst mul1}; do
    [ -e "$WORK/models/$cb/manifest.json" ] && continue
    dense=--no-dense; [ "$cb" = mcg ] && dense=
    /usr/bin/time -f "make-tiny $cb: %e s" python3 -m hybrid_exl3_fixes.cli make-tiny "$WORK/models/$cb" \
      --preset qwen3.6-27b --codebook "$cb" --device cuda $dense
  done
  du -sh "$WORK"/models/*/* | sed 's/^/  /'
  python3 bench/serving.py "$WORK/models" --out "$WORK/results" --deadline $((BUDGET - SECONDS)) \
    --engine-timeout $((BUDGET - SECONDS)) "$@"
  echo "== $(date -u +%FT%TZ) done"
} 2>&1 | tee -a "$WORK/results-driver.log"
cp "$WORK/results-driver.log" "$WORK/results/" 2>/dev/null
tar czf "$OUT/serving-results.tgz" -C "$WORK/results" .
