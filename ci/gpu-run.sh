#!/usr/bin/env bash
# The GPU driver: one prelude (the staged aphrodite's site, this project installed once, a Triton cache and a
# port range per release), then named stages, all started at once and waited for. Run detached on the H200 by
# ci/device-bg.sh after the staging calls (ci/stage-0.24.sh for 0.24.x, ci/stage-0.21.sh for 0.21.0).
#   bash ci/gpu-run.sh RELEASE STAGE[:ARG] ...
#   RELEASE   0.24 (/tmp/devsite24: site/ and torch/) or 0.21 (/tmp/devsite)
#   server:CELLS           tests/gpu/test_server.py, HXF_SERVER_CELLS=CELLS (comma list; the tiny dense model)
#   moe:CELLS              tests/gpu/test_moe_server.py, the same for the MoE cells
#   upstream               tests/upstream with the overlay
#   p12                    tests/gpu/test_p12_mid_batch.py (P12's routed layers against aphrodite's path, 0.24+)
#   p13                    tests/gpu/test_p13_moe_expert_lora.py (P13's decomposed EXL3 experts against dense weights and
#                          the fused kernel, eager and from a CUDA graph, 0.21+)
#   dropin:PATH            one drop-in regression test (PATH under tests/upstream/) on the release as it is, then
#                          with the overlay: it must fail raw and pass with the overlay (dropin/upstream-{raw,overlay}.log)
#   fulldepth:PRESETS      ci/stages/fulldepth.sh, HXF_PRESETS=PRESETS (comma list, NAME or NAME:CODEBOOK) and its
#                          HXF_FD_* settings (kinds, levels, parallel start): full-depth serving beside exllamav3
#   cal:NAMES              make-tiny's calibration checkpoints, then bench/memory_calibration.py --only NAMES
#                          (comma list; empty: all), the machine alone for the profiled rows
#   serving                bench/run-serving.sh HXF_BENCH_SECONDS (default 900): the 27B-width serving benchmark
#   mid-batch              bench/exl3_mid_batch.py on RELEASE (0.24: P12's per-kernel times, the 27B's projections at
#                          1-256 rows, aphrodite's path / the rebuild / a kept float16 weight); best alone on the GPU
#   moe-kernels            bench/exl3_moe_small_batch.py on RELEASE (P16's per-kernel times: one 35B-A3B MoE layer at
#                          1-32 tokens, the release's loop / the grouped exl3_moe / P16, beside the roofline), then
#                          P16's drop-in test raw and with the overlay; alone
#   lora-tune              bench/lora_tune.py: LoRA shrink/expand configs tuned for the 27B's projections within
#                          HXF_TUNE_SECONDS (default 120), in RESULTS/lora-tune (HXF_CMP_LORA_TUNED for compare)
#   kernels                bench/exl3_kernel_choice.py on RELEASE (0.21: P8's per-kernel times, the 27B's projections
#                          at 1/8/16/32 rows); best alone on the GPU (run it before the engines start)
#   exllamav3-build        exllamav3's extension from .cache/wheels/exllamav3-1.6.5-py3-none-any.whl (16 min of
#                          CPU), gzipped to RESULTS/exllamav3_ext.so.gz, to be carried as .cache/exllamav3-ext/
#   state-dtype:PRESET     make-tiny PRESET (a full-depth one) on the GPU, then bench/same_run.py: the config's
#                          float32 GDN state against --mamba-ssm-cache-dtype bfloat16, both engines at once
#                          (HXF_SD_KV_BYTES each, default 28 GiB; --max-num-seqs HXF_SD_SEQS, default 128),
#                          levels HXF_SD_LEVELS (default 1,32,64,128), HXF_SD_REPEATS (default 3); measured only
#                          once the stages named in HXF_SD_AFTER (comma list) have ended, so that their servers
#                          do not share the GPU with the measured levels (the engines start and warm meanwhile);
#                          no level starts after HXF_SD_DEADLINE seconds (default HXF_STAGE_SECONDS, which also caps
#                          the suites), so a suite cut at its cap still leaves the levels their time
#   compare:PRESET         bench/same_run.py on one full-depth checkpoint: each release staged here (0.24.1 in
#                          /tmp/devsite24, 0.21.0 in /tmp/devsite) in the engine's default backends, and exllamav3's
#                          generator (ci/exllamav3-env.sh; started once ci/exllamav3-build.sh's extension is there,
#                          within HXF_CMP_EXT_WAIT seconds, default 900, while the engines start and compile); the copy
#                          bandwidth measured first, on the GPU alone (bench/roofline.py --measure, kept in every JSON);
#                          the compile caches watched (a file appearing inside a level refuses it). Variants: a comma
#                          list in HXF_CMP_VARIANTS of 0.24, 0.24-bf16state (--mamba-ssm-cache-dtype bfloat16, its pool
#                          HXF_CMP_BF16_KV_BYTES), 0.24-lora, 0.24-lora-tuned, 0.24-lora-experts, 0.24-p12, 0.24-keep,
#                          the same for 0.21, 0.21-nop8, exllamav3 (its float16 state) and exllamav3-fp32 (a float32
#                          state); or HXF_CMP_PHASES, groups of them split by ';', run one group after the other (the
#                          variants that do not fit the GPU together), each alternated among itself, one JSON a phase
#                          (NAME-phaseK.json), HXF_CMP_DEADLINES their deadlines (comma list, seconds from each phase's
#                          start). NAME-lora-experts: a MoE preset's lora-experts-3d served through P13
#                          (HYBRID_EXL3_FIXES_MOE_EXPERT_LORA=1); NAME-nop8 / NAME-nop16: P8 / P16 switched off;
#                          NAME-p12: P12 opted into
#                          (HYBRID_EXL3_FIXES_MID_BATCH=1); NAME-keep: P12 with float16 weights kept
#                          (HYBRID_EXL3_FIXES_EXL3_KEEP=HXF_CMP_KEEP, default all); -lora-tuned: the adapter with the
#                          LoRA kernel configs in HXF_CMP_LORA_TUNED, else tuned here first (bench/lora_tune.py, within
#                          HXF_CMP_TUNE_SECONDS, default 120). HXF_CMP_LEVELS (default 1,8,16,32,64), HXF_CMP_REPEATS
#                          (5), HXF_CMP_KV_BYTES per engine (12 GiB), HXF_CMP_BITS (make-tiny --bits; default the
#                          preset's), HXF_CMP_SEQS (--max-num-seqs; default the largest level), HXF_CMP_LORA_KV_BYTES /
#                          HXF_CMP_LORA_SEQS (the adapter variants' pool and --max-num-seqs), HXF_CMP_LORA_ARGS (more
#                          engine flags for them), HXF_CMP_VARIANT_LEVELS (space list of NAME=N,N: same_run.py
#                          --levels), HXF_CMP_PROMPT / HXF_CMP_OUTPUT (tokens; 512 / 256), HXF_CMP_AFTER (stages, comma
#                          list, whose end the measured levels wait for, as HXF_SD_AFTER). Memory: each variant holds
#                          the weights (the 27B 12 GiB at 3 bits) and its state besides (aphrodite's pool; exllamav3's
#                          cache, two state rows a slot: 18 GiB at 64 slots in float32 for the 27B). MTP (issue 58's
#                          page, ci/stages/mtp-compare.sh): variants 0.24-mtpK and 0.24-lora-mtpK (K = 1-3: aphrodite
#                          with --speculative-config method mtp, K tokens; pools HXF_CMP_MTP_KV_BYTES, one per K by
#                          commas) and exllamav3-fp32-mtpK (one exllamav3 process with its MTP head as the draft model,
#                          K draft tokens a level; exllamav3-fp32 itself then drafts none); HXF_CMP_ACCEPT writes the
#                          checkpoint with make-tiny --mtp-acceptance (e.g. 0.63,0.85: one token pool a rate) and
#                          HXF_CMP_POOLS (NAME=LO:HI by commas) runs every level once per pool (same_run.py --pool)
# Results under HXF_RUN_OUT (default /tmp/hxf-out/RELEASE)/STAGE/, one log per stage, STAGE.done as soon as it ends.
# Each run's exact command lines are kept in its record under docs/gpu-runs/. This is the one GPU driver: the
# per-occasion ci/device-session*.sh scripts that earlier records name were folded into these stages (git history
# has them).
set -uo pipefail
cd "$(dirname "$0")/.."
REL=${1:?usage: ci/gpu-run.sh RELEASE STAGE[:ARG] ...}; shift
staged() {  # RELEASE: its SITE, PYPATH (0.24: as its install call wrote it, cutlass's .pth folder in it) and TARGET
  case "$1" in
    0.24) SITE=/tmp/devsite24; PYPATH=$(cat "$SITE/pythonpath" 2>/dev/null || echo "$SITE/torch:$SITE/site")
          TARGET="$SITE/site" ;;
    0.21) SITE=/tmp/devsite; PYPATH="$SITE"; TARGET="$SITE" ;;
    *) return 1 ;;
  esac
}
staged "$REL" || { echo "gpu-run: RELEASE is 0.24 or 0.21, not $REL" >&2; exit 2; }
PORTS=0; [ "$REL" = 0.21 ] || PORTS=1000
ROOT="${HXF_RUN_OUT:-/tmp/hxf-out/$REL}"
mkdir -p "$ROOT"
[ -d "$TARGET/aphrodite" ] || { echo "gpu-run: $TARGET has no aphrodite: run the staging install call first"; exit 3; }
export PYTHONUNBUFFERED=1 APHRODITE_NO_USAGE_STATS=1 PATH="$SITE/bin:$PATH" PYTHONPATH="$PYPATH" HXF_SITE=""
export TRITON_CACHE_DIR="/tmp/hxf-triton-$REL" HXF_SERVER_START_TIMEOUT="${HXF_SERVER_START_TIMEOUT:-900}"
if ls .cache/compile-caches/caches* > /dev/null 2>&1; then  # carried: ci/device-collect.sh's parts of an earlier run
  cat .cache/compile-caches/caches* | tar xzf - -C / 2>/dev/null
  echo "== compile caches restored from $(ls .cache/compile-caches/caches* | wc -l) parts (docs/development.md)"
fi
bash ci/site-install.sh "$TARGET"
echo "== $(date -u +%FT%TZ) $REL: $(python3 -c 'import aphrodite, torch; print("aphrodite", aphrodite.__version__, "torch", torch.__version__)' 2>&1 | tail -1)"
python3 -m hybrid_exl3_fixes.cli status > "$ROOT/status.txt" 2>&1

suite() {  # NAME TEST [CELLS]
  OUT="$ROOT/$1" HXF_GPU_WORK="/tmp/hxf-gpu-$REL-$1" HXF_SERVER_CELLS="${3:-}" \
    HXF_PORT_OFFSET=$((PORTS + ${4:-0})) HXF_PYTEST_TIMEOUT="${HXF_STAGE_SECONDS:-1500}" bash ci/gpu.sh "$2"
}

dropin() {  # DIR TEST: a drop-in (TEST under tests/upstream/) on the release as it is, then with the overlay; it must
  # fail raw and pass with the overlay; DIR/upstream-{raw,overlay}.log
  local mode
  for mode in raw overlay; do
    HYBRID_EXL3_FIXES_UPSTREAM_MODE=$mode timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      "tests/upstream/$2" > "$1/upstream-$mode.log" 2>&1
    echo "drop-in $2: $mode: rc $? ($(tail -1 "$1/upstream-$mode.log"))"
  done
}

mk() { bash ci/make-model.sh "$@"; }  # DIR MAKE-TINY-ARGS...: one writer per checkpoint, none when it is written

inputs() {  # CHECKPOINT OUT: the checkpoint's config and tensor list as doctor reads them (memory_calibration.save_inputs)
  python3 -c "import sys; sys.path.insert(0, 'bench'); import memory_calibration as c; from pathlib import Path; c.save_inputs(Path(sys.argv[1]).parent, Path(sys.argv[2]), Path(sys.argv[1]).name + '/exl3')" "$1" "$2"
}

state_dtype() {  # PRESET
  local m="/tmp/hxf-models/$1" kv="${HXF_SD_KV_BYTES:-$((28 << 30))}" seqs="${HXF_SD_SEQS:-128}"
  mk "$m" --preset "$1"
  mkdir -p "$ROOT/state-dtype"
  inputs "$m" "$ROOT/state-dtype"
  local after=() s
  for s in ${HXF_SD_AFTER:+${HXF_SD_AFTER//,/ }}; do after+=(--hold-until "$ROOT/$s.done"); done
  local common="--gpu-memory-utilization 0.3 --kv-cache-memory-bytes $kv --max-num-seqs $seqs"
  python3 bench/same_run.py "$m/exl3" --out "$ROOT/state-dtype/$1.json" --port $((8400 + PORTS)) \
    --concurrency "${HXF_SD_LEVELS:-1,32,64,128}" --repeats "${HXF_SD_REPEATS:-3}" --deadline "${HXF_SD_DEADLINE:-${HXF_STAGE_SECONDS:-1500}}" "${after[@]}" \
    --variant "float32-state=$common" --variant "bf16-state=$common --mamba-ssm-cache-dtype bfloat16"
}

compare() {  # PRESET
  local name=$1 bits=() m levels=${HXF_CMP_LEVELS:-1,8,16,32,64} kv=${HXF_CMP_KV_BYTES:-$((12 << 30))} args=()
  [ -z "${HXF_CMP_BITS:-}" ] || bits=(--bits "$HXF_CMP_BITS")
  m="/tmp/hxf-models/$name${HXF_CMP_BITS:+-${HXF_CMP_BITS}bit}${HXF_CMP_ACCEPT:+-accept}"
  local accept=(); [ -z "${HXF_CMP_ACCEPT:-}" ] || accept=(--mtp-acceptance "$HXF_CMP_ACCEPT")
  mk "$m" --preset "$name" "${bits[@]}" "${accept[@]}"
  mkdir -p "$ROOT/compare"
  inputs "$m" "$ROOT/compare"
  # the copy bandwidth of the roofline, on this GPU before any engine holds it (every phase's JSON keeps it)
  python3 bench/roofline.py --measure > "$ROOT/compare/bandwidth.json" 2> "$ROOT/compare/bandwidth.log" \
    || { echo "compare: no bandwidth measured (bandwidth.log)"; rm -f "$ROOT/compare/bandwidth.json"; }
  # the engine's defaults (FlashInfer's GDN prefill on SM90, the checkpoint's vision tower loaded: make-tiny writes
  # one), the pool pinned so that the engines can start at once
  local seqs=${HXF_CMP_SEQS:-${levels##*,}}
  local common="--gpu-memory-utilization 0.15 --kv-cache-memory-bytes $kv --max-num-seqs $seqs"
  local bcommon="--gpu-memory-utilization 0.15 --kv-cache-memory-bytes ${HXF_CMP_BF16_KV_BYTES:-$kv} --max-num-seqs $seqs"
  local lkv=${HXF_CMP_LORA_KV_BYTES:-$kv} lseqs=${HXF_CMP_LORA_SEQS:-$seqs}
  local lcommon="--gpu-memory-utilization 0.15 --kv-cache-memory-bytes $lkv --max-num-seqs $lseqs ${HXF_CMP_LORA_ARGS:-}"
  local lora="--enable-lora --max-lora-rank 8 --max-loras 1 --lora-modules bench=$m/lora-mlp"
  local tuned="${HXF_CMP_LORA_TUNED:-$ROOT/compare/lora-tuned}"
  local want rel
  has() { case "$want" in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
  variants() {  # the same_run.py arguments of the comma list in $want, into args
    args=()
    for rel in 0.24 0.21; do
      local SITE PYPATH TARGET; staged "$rel"
      [ -d "$TARGET/aphrodite" ] || { echo "compare: $rel is not staged here; its variants are left out"; continue; }
      [ "$rel" = "$REL" ] || [ -e "$TARGET/.hxf-installed" ] || { bash ci/site-install.sh "$TARGET" && touch "$TARGET/.hxf-installed"; }
      local env="PYTHONPATH=$PYPATH PATH=$SITE/bin:$PATH"
      has "$rel" && args+=(--variant "aphrodite-$rel=$common" --variant-env "aphrodite-$rel=$env")
      has "$rel-bf16state" && args+=(--variant "aphrodite-$rel-bf16state=$bcommon --mamba-ssm-cache-dtype bfloat16"
        --variant-env "aphrodite-$rel-bf16state=$env")
      has "$rel-lora" && args+=(--variant "aphrodite-$rel-lora=$lcommon $lora" --variant-env "aphrodite-$rel-lora=$env")
      if has "$rel-lora-tuned"; then  # the configs tuned first (the lora-tune stage's, or here, no engine up yet)
        [ -e "$tuned/lora_tune.json" ] || env PYTHONPATH="$PYPATH" python3 bench/lora_tune.py --out "$tuned" --deadline "${HXF_CMP_TUNE_SECONDS:-120}" \
          > "$ROOT/compare/lora-tune.log" 2>&1 || echo "compare: lora_tune failed (lora-tune.log); defaults stand"
        args+=(--variant "aphrodite-$rel-lora-tuned=$lcommon $lora"
          --variant-env "aphrodite-$rel-lora-tuned=$env APHRODITE_TUNED_CONFIG_FOLDER=$tuned")
      fi
      has "$rel-lora-experts" && args+=(  # a MoE preset's expert adapter, served through P13 (opted in)
        --variant "aphrodite-$rel-lora-experts=$lcommon --enable-lora --max-lora-rank 8 --max-loras 1 --lora-modules bench=$m/lora-experts-3d"
        --variant-env "aphrodite-$rel-lora-experts=$env HYBRID_EXL3_FIXES_MOE_EXPERT_LORA=1")
      has "$rel-p12" && args+=(--variant "aphrodite-$rel-p12=$common"
        --variant-env "aphrodite-$rel-p12=$env HYBRID_EXL3_FIXES_MID_BATCH=1")
      has "$rel-keep" && args+=(--variant "aphrodite-$rel-keep=$common"
        --variant-env "aphrodite-$rel-keep=$env HYBRID_EXL3_FIXES_EXL3_KEEP=${HXF_CMP_KEEP:-all}")
      has "$rel-nop8" && args+=(--variant "aphrodite-$rel-nop8=$common"
        --variant-env "aphrodite-$rel-nop8=$env HYBRID_EXL3_FIXES_DISABLE=P8")
      has "$rel-nop16" && args+=(--variant "aphrodite-$rel-nop16=$common"
        --variant-env "aphrodite-$rel-nop16=$env HYBRID_EXL3_FIXES_DISABLE=P16")
      local k spec mkv
      for k in 1 2 3; do  # MTP with k speculative tokens, each its own pool (HXF_CMP_MTP_KV_BYTES: one per k)
        spec="--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":$k}'"
        IFS=',' read -ra mkv <<< "${HXF_CMP_MTP_KV_BYTES:-$kv,$kv,$kv}"
        local mc="--gpu-memory-utilization 0.15 --kv-cache-memory-bytes ${mkv[$((k - 1))]:-$kv} --max-num-seqs $seqs"
        has "$rel-mtp$k" && args+=(--variant "aphrodite-$rel-mtp$k=$mc $spec" --variant-env "aphrodite-$rel-mtp$k=$env")
        has "$rel-lora-mtp$k" && args+=(--variant "aphrodite-$rel-lora-mtp$k=$mc $lora ${HXF_CMP_LORA_ARGS:-} $spec"
          --variant-env "aphrodite-$rel-lora-mtp$k=$env")
      done
    done
    for v in exllamav3 exllamav3-fp32; do  # started by same_run.py once the extension is unpacked
      local drafts=() k
      for k in 1 2 3; do has "$v-mtp$k" && drafts+=("$k"); done
      has "$v" || [ ${#drafts[@]} -gt 0 ] || continue
      local flags=""; [ "$v" = exllamav3-fp32 ] && flags="--state-dtype float32"
      # its MTP head loaded as the draft model, the generator built for the largest k; NAME itself then drafts none
      [ ${#drafts[@]} -gt 0 ] && flags="$flags --mtp ${drafts[-1]}"
      args+=(--exllamav3 "$v${flags:+=$flags}" --variant-env "$v=PYTHONPATH=$x3" --start-after "$v=$ready")
      for k in "${drafts[@]}"; do args+=(--exllamav3-draft "$v-mtp$k=$v:$k"); done
    done
    local pool; for pool in ${HXF_CMP_POOLS:+${HXF_CMP_POOLS//,/ }}; do args+=(--pool "$pool"); done
  }
  local ready=/tmp/hxf-exl3-ready x3
  rm -f "$ready"
  # exllamav3's PYTHONPATH, its sources unpacked once here (before the wait below sources the same script)
  x3=$(env PYTHONPATH=/tmp/devsite bash -c 'source ci/exllamav3-env.sh > /dev/null && echo "$PYTHONPATH"')
  # the env script knows where the extension may come from and unpacks it once it is there
  ( ext() { ( source ci/exllamav3-env.sh > /dev/null; [ -e "$EXL3_ROOT/bin/exllamav3_ext.so" ] ); }
    waited=0
    until ext || [ $waited -ge "${HXF_CMP_EXT_WAIT:-900}" ]; do sleep 10; waited=$((waited + 10)); done
    if ext; then : > "$ready"
    else echo "no exllamav3 extension after ${waited} s (ci/exllamav3-build.sh)" > "$ready"; fi ) &
  # phases: variants that do not fit the GPU together run one group after the other (HXF_CMP_PHASES, groups split
  # by ';'), each group alternated among itself; one JSON a phase, NAME-phaseK.json (bench/compare_report.py
  # takes them all); without HXF_CMP_PHASES one phase of HXF_CMP_VARIANTS
  local phases=${HXF_CMP_PHASES:-${HXF_CMP_VARIANTS:-0.24,0.24-lora,0.21,0.21-lora,exllamav3}} k=0 group deadline
  local watch=(--watch-dir "$TRITON_CACHE_DIR" --watch-dir /tmp/torchinductor_root --watch-dir "$HOME/.cache/flashinfer"
    --watch-dir "$HOME/.cache/aphrodite/torch_compile_cache")
  local bw=(); [ -e "$ROOT/compare/bandwidth.json" ] && bw=(--bandwidth-file "$ROOT/compare/bandwidth.json")
  IFS=';' read -ra groups <<< "$phases"
  IFS=',' read -ra deadlines <<< "${HXF_CMP_DEADLINES:-}"
  for group in "${groups[@]}"; do
    want=",$group,"; variants
    deadline=${deadlines[$k]:-${HXF_CMP_DEADLINE:-${HXF_STAGE_SECONDS:-1500}}}
    k=$((k + 1))
    [ ${#args[@]} -gt 0 ] || { echo "compare: phase $k has no variant to run"; continue; }
    local s; for s in ${HXF_CMP_AFTER:+${HXF_CMP_AFTER//,/ }}; do args+=(--hold-until "$ROOT/$s.done"); done
    for s in ${HXF_CMP_VARIANT_LEVELS:-}; do args+=(--levels "$s"); done
    local json="$ROOT/compare/$(basename "$m").json"; [ ${#groups[@]} -gt 1 ] && json="$ROOT/compare/$(basename "$m")-phase$k.json"
    echo "== $(date -u +%FT%TZ) compare phase $k: $group (deadline $deadline s)"
    python3 bench/same_run.py "$m/exl3" --out "$json" --port $((8500 + PORTS + 10 * k)) \
      --concurrency "$levels" --prompt "${HXF_CMP_PROMPT:-512}" --output "${HXF_CMP_OUTPUT:-256}" \
      --repeats "${HXF_CMP_REPEATS:-5}" --deadline "$deadline" "${bw[@]}" "${watch[@]}" "${args[@]}"
  done
}

fulldepth() {  # PRESETS
  HXF_SITE="$SITE" HXF_PYTHONPATH="$PYPATH" HXF_FD_OUT="$ROOT/fulldepth" HXF_FD_NO_INSTALL=1 \
    HXF_PRESETS="${1//,/ }" HXF_FD_SECONDS="${HXF_STAGE_SECONDS:-1500}" bash ci/stages/fulldepth.sh
}

cal() {  # NAMES (bench/memory_calibration.py's configuration names; empty: every one)
  local models=/tmp/hxf-cal/models names=",$1,"
  wants() { [ "$names" = ",," ] || case "$names" in *",$1"*) return 0 ;; *) return 1 ;; esac; }  # a name starting with $1
  wants 9b- && mk "$models/9b" --preset qwen3.5-9b-full --vision published  # the tower only the vision row reads
  wants 27b-4layer && mk "$models/27b4" --preset qwen3.6-27b --codebook mcg --device cuda
  wants 27b-24g && mk "$models/27b" --preset qwen3.6-27b-full
  wants 35b4- && mk "$models/35b4" --preset qwen3.6-35b-a3b --device cuda
  wants 35b-a3b- && mk "$models/35b" --preset qwen3.6-35b-a3b-full --bits 2
  python3 bench/memory_calibration.py "$models" --out "$ROOT/cal" --deadline "${HXF_STAGE_SECONDS:-1200}" ${1:+--only "$1"}
}

serving() {
  OUT="$ROOT/serving" HXF_SITE="$TARGET" HXF_CODEBOOKS=mcg bash bench/run-serving.sh "${HXF_BENCH_SECONDS:-900}" \
    --only concurrency,lora --engines exl3,exl3+lora --repeats 2
}

exllamav3_build() {
  bash ci/exllamav3-build.sh && cp /tmp/exllamav3_ext.so.gz "$ROOT/exllamav3_ext.so.gz"
}

i=0
for stage in "$@"; do
  name=${stage%%:*} arg=""; [ "$stage" = "$name" ] || arg=${stage#*:}
  mkdir -p "$ROOT/$name"; rm -f "$ROOT/$name.done"
  { case "$name" in
    server) suite server tests/gpu/test_server.py "$arg" 0 ;;
    moe) suite moe tests/gpu/test_moe_server.py "$arg" 100 ;;
    mtp) suite mtp tests/gpu/test_mtp_server.py "$arg" 500 ;;
    upstream) suite upstream tests/upstream "" 200 ;;
    state-dtype) state_dtype "$arg" ;;
    compare) compare "${arg:-qwen3.6-35b-a3b-full}" ;;
    fulldepth) fulldepth "${arg:-qwen3.6-27b-full}" ;;
    cal) cal "$arg" ;;
    serving) serving ;;
    exllamav3-build) exllamav3_build ;;
    kernels) python3 bench/exl3_kernel_choice.py --out "$ROOT/kernels" ;;
    mid-batch) python3 bench/exl3_mid_batch.py --out "$ROOT/mid-batch" ;;
    moe-kernels) python3 bench/exl3_moe_small_batch.py --out "$ROOT/moe-kernels"
      dropin "$ROOT/moe-kernels" tests/kernels/moe/test_exl3_moe_small_batch.py ;;  # P16's drop-in
    dropin) dropin "$ROOT/dropin" "$arg" ;;
    lora-tune) python3 bench/lora_tune.py --out "$ROOT/lora-tune" --deadline "${HXF_TUNE_SECONDS:-120}" ;;
    p12) suite p12 tests/gpu/test_p12_mid_batch.py "" 300 ;;
    p13) suite p13 tests/gpu/test_p13_moe_expert_lora.py "" 400 ;;
    *) echo "gpu-run: unknown stage $name" ;;
  esac; touch "$ROOT/$name.done"; } > "$ROOT/$name.log" 2>&1 &
  i=$((i + 1))
done
wait
for stage in "$@"; do echo "== $(date -u +%FT%TZ) ${stage%%:*}: $(tail -1 "$ROOT/${stage%%:*}.log")"; done
