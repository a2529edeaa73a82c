#!/usr/bin/env bash
# Issue 17, deliverable 4: the current release (aphrodite-engine 0.24.x, torch 2.13) on the H200, beside the 0.21.0
# session. After ci/stage-0.24.sh's stash calls and its install call (/tmp/devsite24: torch/ and site/), run
# detached by ci/device-bg.sh. Its GPU suites at once, each in its own work folder, Triton cache (0.24 pins
# triton 3.7.1) and port range (HXF_PORT_OFFSET), at nice 10 so that a 0.21.0 suite started beside it keeps the CPU:
#   dense/  tests/gpu/test_server.py, HXF_V24_DENSE_CELLS (default compiled-bf16-lora: the user's configuration;
#           none: not run)
#   moe/    tests/gpu/test_moe_server.py, HXF_V24_MOE_CELLS (default: compiled with and without LoRA, the expert
#           adapter's refusal, and the overlay off, which records 0.24's own first error)
#   upstream/ tests/upstream with the overlay (P7's, P9's and P10's EXL3 MoE drop-ins among them); HXF_V24_UPSTREAM=0: not run
#   control-noP10/, control-raw/  HXF_V24_CONTROLS=1: P10's drop-in with P10 off and with aphrodite as released
# HXF_V24_OUT: the results folder (default /tmp/hxf-out/v24; a second session on the same machine names its own).
# HXF_TRACE_EXL3_MOE=1: every ops.exl3_moe call logged by the servers (docs/upstream/repro/trace_exl3_moe/).
# Results under /tmp/hxf-out/v24/; /tmp/hxf-out/v24.done is touched at the end, whatever happens (other jobs'
# benchmarks wait for it).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="${HXF_V24_OUT:-/tmp/hxf-out/v24}" SITE=/tmp/devsite24
mkdir -p "$ROOT"
trap 'touch /tmp/hxf-out/v24.done' EXIT
[ -d "$SITE/site/aphrodite" ] || { echo "v24: $SITE/site has no aphrodite: run .devstage-0.24/install/install.sh first"; exit 3; }
export PYTHONUNBUFFERED=1 APHRODITE_NO_USAGE_STATS=1 PATH="$SITE/bin:$PATH"
# this project installed once (two ci/gpu.sh installing into one --target at once would race), then HXF_SITE=""
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target "$SITE/site" . 2>&1 | grep -v "^WARNING: Target" | tail -3
TRACE=""; [ "${HXF_TRACE_EXL3_MOE:-0}" = 1 ] && TRACE="$PWD/docs/upstream/repro/trace_exl3_moe:"
export PYTHONPATH="$TRACE$SITE/site:$SITE/torch" HXF_SITE="" HXF_PORT_OFFSET=1000
export TRITON_CACHE_DIR=/tmp/hxf-triton-cache24 HXF_SERVER_START_TIMEOUT="${HXF_SERVER_START_TIMEOUT:-600}"
echo "== $(date -u +%FT%TZ) v24: $(python3 -c 'import aphrodite, torch; print("aphrodite", aphrodite.__version__, "torch", torch.__version__, torch.version.cuda)' 2>&1 | tail -1)"
suite() {  # NAME TEST CELLS ("none": the suite does not run)
  [ "$3" = none ] && { echo "== $(date -u +%FT%TZ) v24 $1: not run (cells: none)"; return; }
  OUT="$ROOT/$1" HXF_GPU_WORK="/tmp/hxf-gpu24-$1" HXF_SERVER_CELLS="$3" HXF_PYTEST_TIMEOUT="${HXF_V24_SECONDS:-840}" \
    nice -n 10 bash ci/gpu.sh "$2" > "$ROOT/$1.log" 2>&1
  echo "== $(date -u +%FT%TZ) v24 $1: exit $? $(tail -1 "$ROOT/$1.log")"
}
controls() {  # HXF_V24_CONTROLS=1: P10's drop-in without its fix (P10 off: the capture error; raw: as released)
  [ "${HXF_V24_CONTROLS:-0}" = 1 ] || return 0
  HYBRID_EXL3_FIXES_DISABLE=P10 suite control-noP10 tests/upstream/tests/kernels/moe/test_exl3_moe_context_capture.py all
  HYBRID_EXL3_FIXES_UPSTREAM_MODE=raw suite control-raw tests/upstream/tests/kernels/moe/test_exl3_moe_context_capture.py all
}
controls &
suite dense tests/gpu/test_server.py "${HXF_V24_DENSE_CELLS:-compiled-bf16-lora}" &
[ "${HXF_V24_UPSTREAM:-1}" = 1 ] && suite upstream tests/upstream all &  # the drop-ins with the overlay (P9's)
suite moe tests/gpu/test_moe_server.py \
  "${HXF_V24_MOE_CELLS:-moe-compiled-bf16-nolora,moe-compiled-bf16-lora,moe-eager-bf16-lora-experts,moe-lora-unpatched}" &
wait
