#!/usr/bin/env bash
# The GPU driver: one prelude (the staged aphrodite's site, this project installed once, a Triton cache and a
# port range per release), then named stages, all started at once and waited for. Run detached on the H200 by
# ci/device-bg.sh after the staging calls (ci/stage-0.24.sh for 0.24.x, ci/stage-0.21.sh for 0.21.0).
#   bash ci/gpu-run.sh RELEASE STAGE[:ARG] ...
#   RELEASE   0.24 (/tmp/devsite24: site/ and torch/) or 0.21 (/tmp/devsite)
#   server:CELLS           tests/gpu/test_server.py, HXF_SERVER_CELLS=CELLS (comma list; the tiny dense model)
#   moe:CELLS              tests/gpu/test_moe_server.py, the same for the MoE cells
#   upstream               tests/upstream with the overlay
#   state-dtype:PRESET     make-tiny PRESET (a full-depth one) on the GPU, then bench/same_run.py: the config's
#                          float32 GDN state against --mamba-ssm-cache-dtype bfloat16, both engines at once
#                          (HXF_SD_KV_BYTES each, default 28 GiB; --max-num-seqs HXF_SD_SEQS, default 128),
#                          levels HXF_SD_LEVELS (default 1,32,64,128), HXF_SD_REPEATS (default 3)
# Results under HXF_RUN_OUT (default /tmp/hxf-out/RELEASE)/STAGE/, one log per stage, STAGE.done when it ends.
# Each run's exact command lines are kept in its record under docs/gpu-runs/.
set -uo pipefail
cd "$(dirname "$0")/.."
REL=${1:?usage: ci/gpu-run.sh RELEASE STAGE[:ARG] ...}; shift
case "$REL" in
  0.24) SITE=/tmp/devsite24; PYPATH="$SITE/site:$SITE/torch"; TARGET="$SITE/site"; PORTS=1000 ;;
  0.21) SITE=/tmp/devsite; PYPATH="$SITE"; TARGET="$SITE"; PORTS=0 ;;
  *) echo "gpu-run: RELEASE is 0.24 or 0.21, not $REL" >&2; exit 2 ;;
esac
ROOT="${HXF_RUN_OUT:-/tmp/hxf-out/$REL}"
mkdir -p "$ROOT"
[ -d "$TARGET/aphrodite" ] || { echo "gpu-run: $TARGET has no aphrodite: run the staging install call first"; exit 3; }
export PYTHONUNBUFFERED=1 APHRODITE_NO_USAGE_STATS=1 PATH="$SITE/bin:$PATH" PYTHONPATH="$PYPATH" HXF_SITE=""
export TRITON_CACHE_DIR="/tmp/hxf-triton-$REL" HXF_SERVER_START_TIMEOUT="${HXF_SERVER_START_TIMEOUT:-900}"
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target "$TARGET" . 2>&1 \
  | grep -v "^WARNING: Target" | tail -3
echo "== $(date -u +%FT%TZ) $REL: $(python3 -c 'import aphrodite, torch; print("aphrodite", aphrodite.__version__, "torch", torch.__version__)' 2>&1 | tail -1)"
python3 -m hybrid_exl3_fixes.cli status > "$ROOT/status.txt" 2>&1

suite() {  # NAME TEST [CELLS]
  OUT="$ROOT/$1" HXF_GPU_WORK="/tmp/hxf-gpu-$REL-$1" HXF_SERVER_CELLS="${3:-}" \
    HXF_PORT_OFFSET=$((PORTS + ${4:-0})) HXF_PYTEST_TIMEOUT="${HXF_STAGE_SECONDS:-1500}" bash ci/gpu.sh "$2"
}

state_dtype() {  # PRESET
  local m="/tmp/hxf-models/$1" kv="${HXF_SD_KV_BYTES:-$((28 << 30))}" seqs="${HXF_SD_SEQS:-128}"
  [ -e "$m/manifest.json" ] || /usr/bin/time -f "make-tiny $1: %e s" python3 -m hybrid_exl3_fixes.cli make-tiny "$m" --preset "$1"
  mkdir -p "$ROOT/state-dtype"
  python3 -c "import sys; sys.path.insert(0, 'bench'); import memory_calibration as c; from pathlib import Path; c.save_inputs(Path('/tmp/hxf-models'), Path('$ROOT/state-dtype'), '$1/exl3')"
  local common="--gpu-memory-utilization 0.3 --kv-cache-memory-bytes $kv --max-num-seqs $seqs --gdn-prefill-backend triton --language-model-only"
  python3 bench/same_run.py "$m/exl3" --out "$ROOT/state-dtype/$1.json" --port $((8400 + PORTS)) \
    --concurrency "${HXF_SD_LEVELS:-1,32,64,128}" --repeats "${HXF_SD_REPEATS:-3}" --deadline "${HXF_STAGE_SECONDS:-1500}" \
    --variant "float32-state=$common" --variant "bf16-state=$common --mamba-ssm-cache-dtype bfloat16"
}

i=0
for stage in "$@"; do
  name=${stage%%:*} arg=""; [ "$stage" = "$name" ] || arg=${stage#*:}
  mkdir -p "$ROOT/$name"
  case "$name" in
    server) suite server tests/gpu/test_server.py "$arg" 0 ;;
    moe) suite moe tests/gpu/test_moe_server.py "$arg" 100 ;;
    upstream) suite upstream tests/upstream "" 200 ;;
    state-dtype) state_dtype "$arg" ;;
    *) echo "gpu-run: unknown stage $name" ;;
  esac > "$ROOT/$name.log" 2>&1 &
  i=$((i + 1))
done
wait
for stage in "$@"; do touch "$ROOT/${stage%%:*}.done"; echo "== $(date -u +%FT%TZ) ${stage%%:*}: $(tail -1 "$ROOT/${stage%%:*}.log")"; done
