#!/usr/bin/env bash
# Issues 17, 18 and 19 in one H200 device session (after ci/stage-0.21.sh's calls and its install
# call, with .cache/wheels/exllamav3-1.6.5-py3-none-any.whl carried), run detached by ci/device-bg.sh so
# it may outlast one device call. Each stage is resumable; results under /tmp/hxf-out/{moe,fulldepth,cal}.
#   0. in the background from the start: the checkpoints of the later stages (make-tiny's full-depth presets and
#      the 4-layer ones for calibration, on the GPU; the 35B-A3B at full depth, CPU-heavy (738 s in run 11), only
#      if HXF_CAL_ONLY names it), and exllamav3's extension (ci/exllamav3-build.py, 16 min of CPU beside other
#      work in run 12; the gzipped module is left in /tmp/hxf-out/ to be brought back as .cache/exllamav3-ext/)
#      only if it was not carried
#   upstream: tests/upstream on the GPU, with the overlay and raw (upstream-{overlay,raw}/; raw must fail where
#      the drop-ins test a bug the release has)
#   fdstart: ci/device-session-fulldepth.sh in the background with HXF_FD_PARALLEL=1 once its checkpoint is
#      written: both engines start beside the next stages (correctness only), and measure only once moe has
#      ended (moe.done) and every file in HXF_FD_GATE_EXTRA exists (e.g. another job's); fdwait waits for it
#   1. moe: the MoE server suite (tests/gpu/test_moe_server.py, cells HXF_SERVER_CELLS), with py-spy
#      dumps of every process of a MoE server that has not started, or has started and not answered,
#      at 240, 330 and 420 s (moe/pyspy.txt); touches moe.done at the end
#   2. fulldepth: ci/device-session-fulldepth.sh once its checkpoint is written and any extension build
#      has ended (it would take the benchmark's CPU); the engines one after the other, the machine alone
#   gate: waits for the files in HXF_GATE (e.g. "gate cal" after the 0.24 job: calibration needs the GPU alone)
#   3. cal: bench/memory_calibration.py (--only HXF_CAL_ONLY) in the time left, the machine alone
#   HXF_STAGES="moe fulldepth cal" (default; "upstream fdstart moe fdwait cal" overlaps the full-depth start-ups
#      with the MoE suite)  HXF_SESSION_SECONDS (default 1560): no stage starts after it
set -uo pipefail
cd "$(dirname "$0")/.."
SITE="${HXF_SITE:-/tmp/devsite}" ROOT=/tmp/hxf-out
BUDGET="${HXF_SESSION_SECONDS:-1560}" STAGES="${HXF_STAGES:-moe fulldepth cal}"
mkdir -p "$ROOT/moe" "$ROOT/cal" /tmp/hxf-cal/models /tmp/hxf-fd/models
export PYTHONUNBUFFERED=1 APHRODITE_NO_USAGE_STATS=1 PATH="$SITE/bin:$PATH" PYTHONPATH="$SITE"
left() { echo $((BUDGET - SECONDS)); }
stamp() { echo "== $(date -u +%FT%TZ) [${SECONDS} s] $*"; }
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target "$SITE" . 2>&1 | grep -v "^WARNING: Target" | tail -3
stamp "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"; df -h /tmp | tail -1

EXT=.cache/exllamav3-ext/exllamav3_ext.so.gz WHEEL=.cache/wheels/exllamav3-1.6.5-py3-none-any.whl
build=""
if [ ! -e "$EXT" ] && [ -e "$WHEEL" ]; then
  (
    export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=12 TORCH_EXTENSIONS_DIR=/tmp/exl3-ext
    nice -n 19 python3 ci/exllamav3-build.py "$WHEEL" || exit 1
    so=$(find /tmp/exl3-ext -name 'exllamav3_ext*.so' | head -1)
    mkdir -p "$(dirname "$EXT")" && gzip -c "$so" > "$EXT" && cp "$EXT" "$ROOT/"
  ) > "$ROOT/exl3-build.log" 2>&1 &
  build=$!
fi
wait_build() {  # the full-depth stages: an extension build would take the benchmark's CPU
  [ -z "$build" ] || { stamp "waiting for the exllamav3 build"; wait "$build"; stamp "build exit $?"; tail -3 "$ROOT/exl3-build.log"; build=""; }
}
mk() { [ -e "$1/manifest.json" ] || /usr/bin/time -f "make-tiny $1: %e s" python3 -m hybrid_exl3_fixes.cli make-tiny "$@"; }
# in the background from the start: about 2 min, on the GPU. (Run 12's MoE servers went silent beside a CPU-heavy
# writer and a 12-job nvcc build, cause not found: docs/upstream/exl3-moe-compiled-graph-capture.md; the CPU-heavy
# full-depth 35B is written by stage cal only, and nothing is built when the extension is carried.)
(
  mk /tmp/hxf-fd/models/qwen3.6-27b-full --preset qwen3.6-27b-full
  ln -sfn /tmp/hxf-fd/models/qwen3.6-27b-full /tmp/hxf-cal/models/27b
  mk /tmp/hxf-cal/models/9b --preset qwen3.5-9b-full
  mk /tmp/hxf-cal/models/27b4 --preset qwen3.6-27b --codebook mcg --device cuda
  mk /tmp/hxf-cal/models/35b4 --preset qwen3.6-35b-a3b --device cuda
) 2>&1 | tr '\r' '\n' | grep -v "/s\]$" > "$ROOT/checkpoints.log" &
writer=$!
fd=""
# py-spy (its wheel is carried in .whl/; pip --target does not add a script to an existing bin/)
[ -x "$SITE/bin/py-spy" ] || unzip -p .whl/py_spy-*.whl 'py_spy-*.data/scripts/py-spy' > "$SITE/bin/py-spy" 2>/dev/null
chmod +x "$SITE/bin/py-spy" 2>/dev/null

watch_moe() {  # what a MoE server that has not started or not answered is doing (runs 11, 12: silent)
  local t pid log
  for t in 240 330 420; do
    sleep $((t - (SECONDS - moe_t0))) 2>/dev/null
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do  # every process: the engine core renames itself
      log=$(readlink "/proc/$pid/fd/1" 2>/dev/null) || continue
      case "$log" in *server-moe-*) ;; *) continue ;; esac
      grep -q '"POST /v1/completions' "$log" 2>/dev/null && continue  # it has answered a request
      grep -q resource_tracker "/proc/$pid/cmdline" 2>/dev/null && continue  # multiprocessing's helper (run 13)
      echo "== t=${t}s pid $pid ($(basename "$log")): $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-120)"
      echo "-- last line: $(tail -1 "$log" | cut -c1-200)"
      timeout 30 py-spy dump --native --pid "$pid" 2>&1 | head -120
    done
  done
}

for stage in $STAGES; do
  [ "$(left)" -gt 240 ] || { stamp "no time left for $stage"; continue; }
  case "$stage" in
    upstream)  # the drop-in upstream tests on the GPU, with the overlay and raw (a minute)
      for mode in overlay raw; do
        HYBRID_EXL3_FIXES_UPSTREAM_MODE=$mode OUT="$ROOT/upstream-$mode" HXF_SITE="" HXF_PYTEST_TIMEOUT=240 \
          bash ci/gpu.sh tests/upstream > "$ROOT/upstream-$mode.log" 2>&1
        stamp "upstream ($mode): exit $? $(tail -1 "$ROOT/upstream-$mode.log")"
      done
      ;;
    moe)
      stamp "moe: $HXF_SERVER_CELLS"
      moe_t0=$SECONDS
      watch_moe > "$ROOT/moe/pyspy.txt" 2>&1 &
      watcher=$!
      OUT="$ROOT/moe" HXF_SITE="" HXF_PYTEST_TIMEOUT="${HXF_SUITE_SECONDS:-600}" bash ci/gpu.sh tests/gpu/test_moe_server.py \
        > "$ROOT/moe/suite.log" 2>&1
      stamp "moe: exit $?"
      kill "$watcher" 2>/dev/null
      tail -25 "$ROOT/moe/suite.log"
      touch "$ROOT/moe.done"
      ;;
    fdstart)
      wait_build
      while [ ! -e /tmp/hxf-fd/models/qwen3.6-27b-full/manifest.json ] && kill -0 "$writer" 2>/dev/null; do sleep 2; done
      gate="${HXF_FD_GATE_EXTRA:-}"; case " $STAGES " in *" moe "* | *" moewait "*) gate="$gate $ROOT/moe.done" ;; esac
      stamp "fdstart (the engines measure once these exist: $gate)"
      # at nice 10: while it starts, the MoE servers beside it keep the CPU (nice changes nothing once it is alone)
      HXF_FD_NO_INSTALL=1 HXF_FD_PARALLEL=1 HXF_FD_GATE="$gate" HXF_FD_SECONDS=$(($(left) - 60)) nice -n 10 bash ci/device-session-fulldepth.sh \
        > "$ROOT/fulldepth.log" 2>&1 &
      fd=$!
      ;;
    gate)  # until every file in HXF_GATE exists (another job's end, e.g. /tmp/hxf-out/v24.done): nothing measures beside it
      for f in ${HXF_GATE:-}; do while [ ! -e "$f" ] && [ "$(left)" -gt 240 ]; do sleep 3; done; done
      stamp "gate: ${HXF_GATE:-nothing to wait for}"
      ;;
    moewait)  # a MoE suite started by an earlier session job (one replaced mid-run): until it ends, then moe.done
      while pgrep -f "test_moe_server[.]py" > /dev/null; do sleep 5; done
      touch "$ROOT/moe.done"; stamp "moe suite ended"
      ;;
    fdwait)
      [ -z "$fd" ] || { wait "$fd"; stamp "fulldepth exit $?"; tail -5 "$ROOT/fulldepth.log"; }
      ;;
    fulldepth)
      wait_build
      wait "$writer" 2>/dev/null; cat "$ROOT/checkpoints.log"  # the 35B is written by stage cal, not here
      stamp "fulldepth"
      HXF_FD_NO_INSTALL=1 HXF_FD_SECONDS=$(($(left) - 60)) bash ci/device-session-fulldepth.sh
      ;;
    cal)
      wait "$writer" 2>/dev/null
      case ",${HXF_CAL_ONLY:-35b-a3b}," in *,35b-a3b*) mk /tmp/hxf-cal/models/35b --preset qwen3.6-35b-a3b-full --bits 2 2>&1 | tail -1 ;; esac
      stamp "memory calibration ${HXF_CAL_ONLY:-all}"
      python3 bench/memory_calibration.py /tmp/hxf-cal/models --out "$ROOT/cal" --deadline "$(($(left) - 30))" \
        ${HXF_CAL_ONLY:+--only "$HXF_CAL_ONLY"}
      stamp "memory calibration exit $?"
      ;;
  esac
done
tar czf "$ROOT/cal-results.tgz" --exclude='*.safetensors' --exclude='calibration-cache' -C "$ROOT/cal" . 2>/dev/null
stamp done
