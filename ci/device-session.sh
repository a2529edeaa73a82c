#!/usr/bin/env bash
# Issue 15 on one H200 (after ci/stage-0.21.sh and its install call), run detached by
# ci/device-bg.sh so it may outlast one device call. Writes /tmp/hxf-out/{server,bench}-results.tgz.
#  1. the server suite (tests/gpu/test_server.py: every cell one `aphrodite run`, all started at once);
#  2. issue 7's serving benchmark on a bfloat16 27B-width checkpoint, default compiled mode, LoRA
#     off and on (bench/run-serving.sh; the engines run alone on the GPU, profiling as usual).
set -uo pipefail
cd "$(dirname "$0")/.."
SITE="${HXF_SITE:-/tmp/devsite}" ROOT=/tmp/hxf-out
mkdir -p "$ROOT/server" "$ROOT/bench"
export PYTHONUNBUFFERED=1 APHRODITE_NO_USAGE_STATS=1 PATH="$SITE/bin:$PATH"
echo "== $(date -u +%FT%TZ) server suite"
# 14 servers compile at once on 16 cores: two Inductor compile workers each
TORCHINDUCTOR_COMPILE_THREADS=2 OUT="$ROOT/server" HXF_SITE="$SITE" HXF_PYTEST_TIMEOUT="${HXF_SUITE_SECONDS:-1500}" bash ci/gpu.sh tests/gpu/test_server.py
echo "== $(date -u +%FT%TZ) server suite exit $?"
tar czf "$ROOT/server-results.tgz" -C "$ROOT/server" .
echo "== $(date -u +%FT%TZ) serving benchmark"
OUT="$ROOT/bench" HXF_SITE="$SITE" HXF_CODEBOOKS=mcg bash bench/run-serving.sh "${HXF_BENCH_SECONDS:-900}" \
  --only concurrency,lora --engines exl3,exl3+lora --repeats 2
echo "== $(date -u +%FT%TZ) serving benchmark exit $?"
cp "$ROOT/bench/serving-results.tgz" "$ROOT/bench-results.tgz" 2>/dev/null
echo "== $(date -u +%FT%TZ) done"
