#!/usr/bin/env bash
# The 27B's mid-batch and LoRA-cost levels (docs/upstream/exl3-mid-batch-rebuild.md): same-run comparisons, one
# after the other, on one checkpoint (make-tiny qwen3.6-27b-full, float32 GDN state), because the variants do not
# fit one H200 together (each aphrodite engine holds the 12 GiB checkpoint and its pinned pool; float32 state takes
# about 205 MB a sequence; kept float16 weights take 47.7 GiB more):
#   1  0.24.1, 0.24.1 + P12 (HYBRID_EXL3_FIXES_MID_BATCH=1), 0.24.1 with lora-mlp, the same with tuned LoRA kernel
#      configs: levels 1, 16, 32, 64, 128 (P12 16-128, the adapters 1 and 32), 26 GiB pools (8.5 for the adapters)
#   2  0.24.1, 0.24.1 + P12 keeping float16 weights (HYBRID_EXL3_FIXES_EXL3_KEEP=all), exllamav3: levels 1-64, 13 GiB
#   3  0.24.1 and 0.24.1 + P12 at 128 and 256 sequences, 50 GiB pools; only where HXF_MB_RUNS names it
#   4  the LoRA-cost levels alone (they fit an H100): 0.24.1 without and with lora-mlp, default and tuned LoRA
#      configs, levels 1 and 32, 8.5 GiB pools, --max-num-seqs 32
# The non-adapter engines of runs 1 - 3 have the same flags (--max-num-seqs HXF_MB_SEQS, the same --max-model-len),
# so a later run finds an earlier one's compile cache. Results: HXF_RUN_OUT (default /tmp/hxf-out/0.24)/mbN for run
# N (each gpu-run.sh's compare/ folder and log). Settings:
#   HXF_MB_RUNS       which runs, in order (default "1 2")
#   HXF_MB_TUNED      the LoRA configs folder for the tuned variant of runs 1 and 4 (ci/gpu-run.sh's HXF_CMP_LORA_TUNED)
#   HXF_MB_REPEATS    repeats of every run (default 2); HXF_MB_DEADLINE_<N> caps run N (seconds from its start)
#   HXF_MB_SEQS       --max-num-seqs of the non-adapter engines (default 256; one run alone needs no shared cache)
#   bash ci/stages/mid-batch-levels.sh                  # after ci/stage-0.24.sh's install call, on the GPU machine
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=${HXF_RUN_OUT:-/tmp/hxf-out/0.24}
export HXF_CMP_PROMPT=512 HXF_CMP_OUTPUT=128 HXF_CMP_SEQS=${HXF_MB_SEQS:-256} HXF_CMP_REPEATS=${HXF_MB_REPEATS:-2}
preset=qwen3.6-27b-full
for run in ${HXF_MB_RUNS:-1 2}; do
  echo "== $(date -u +%FT%TZ) mid-batch run $run"
  case "$run" in
    1) HXF_RUN_OUT=$ROOT/mb1 HXF_CMP_LEVELS=1,16,32,64,128 HXF_CMP_KV_BYTES=$((26 << 30)) \
         HXF_CMP_LORA_KV_BYTES=$((17 << 29)) HXF_CMP_LORA_SEQS=32 HXF_CMP_LORA_TUNED=${HXF_MB_TUNED:-} \
         HXF_CMP_VARIANTS=0.24,0.24-p12,0.24-lora,0.24-lora-tuned HXF_CMP_DEADLINE=${HXF_MB_DEADLINE_1:-1200} \
         HXF_CMP_VARIANT_LEVELS="aphrodite-0.24-p12=16,32,64,128 aphrodite-0.24-lora=1,32 aphrodite-0.24-lora-tuned=1,32" \
         bash ci/gpu-run.sh 0.24 "compare:$preset" ;;
    2) HXF_RUN_OUT=$ROOT/mb2 HXF_CMP_LEVELS=1,16,32,64 HXF_CMP_KV_BYTES=$((13 << 30)) \
         HXF_CMP_VARIANTS=0.24,0.24-keep,exllamav3 HXF_CMP_DEADLINE=${HXF_MB_DEADLINE_2:-900} \
         bash ci/gpu-run.sh 0.24 "compare:$preset" ;;
    3) HXF_RUN_OUT=$ROOT/mb3 HXF_CMP_LEVELS=128,256 HXF_CMP_KV_BYTES=$((50 << 30)) \
         HXF_CMP_VARIANTS=0.24,0.24-p12 HXF_CMP_DEADLINE=${HXF_MB_DEADLINE_3:-600} \
         bash ci/gpu-run.sh 0.24 "compare:$preset" ;;
    4) HXF_RUN_OUT=$ROOT/mb4 HXF_CMP_LEVELS=1,32 HXF_CMP_SEQS=32 HXF_CMP_KV_BYTES=$((17 << 29)) \
         HXF_CMP_LORA_TUNED=${HXF_MB_TUNED:-} HXF_CMP_VARIANTS=0.24,0.24-lora,0.24-lora-tuned \
         HXF_CMP_DEADLINE=${HXF_MB_DEADLINE_4:-900} bash ci/gpu-run.sh 0.24 "compare:$preset" ;;
    *) echo "mid-batch-levels: no run $run (1 - 4)" ;;
  esac
  tail -3 "$ROOT/mb$run/compare.log" 2>/dev/null
done
