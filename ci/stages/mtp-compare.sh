#!/usr/bin/env bash
# Issue 58's same-run page: the 27B at full depth whose MTP head agrees with the trunk at two chosen rates (make-tiny
# --mtp-acceptance 0.63,0.85: token pools 0-249 and 250-499, the prompts of a level drawn from one), served by
# aphrodite 0.24.1 without MTP and with num_speculative_tokens 1, 2, 3, and with the lora-mlp adapter, beside
# exllamav3 1.6.5 drafting with the same MTP head (0-3 tokens a step), float32 GDN state in both, levels 1, 4, 8,
# every level once per pool, 5 repeats, the variants alternated. Run detached after 0.24.1's install call:
#   bash ci/device-bg.sh start r58 bash ci/stages/mtp-compare.sh
# The 27B with a float16 head holds 13.5 GiB of weights per engine and about 2 GiB besides: on a GPU of 135 GiB or
# more the four base variants run in one phase with exllamav3 and the adapter's in a second; on an 80 GB card two
# aphrodite variants a phase with exllamav3, three phases (each aphrodite variant alternated with exllamav3 at its own
# draft size in its phase; exllamav3 without drafting in every phase, the anchor between them; the adapter's phase
# last, so that a short budget cuts it first). Settings: HXF_MC_OUTPUT (tokens, 64), HXF_MC_REPEATS (5),
# HXF_MC_DEADLINES (seconds from each phase's start after which no level starts), HXF_MC_PHASES (the phases, as
# HXF_CMP_PHASES: a shorter set where the device budget is short).
set -uo pipefail
cd "$(dirname "$0")/../.."
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
x3="exllamav3-fp32-mtp"
if [ -n "${HXF_MC_PHASES:-}" ]; then
  phases=$HXF_MC_PHASES deadlines=${HXF_MC_DEADLINES:-600}
elif [ "${mem:-0}" -ge 135000 ]; then
  phases="0.24,0.24-mtp1,0.24-mtp2,0.24-mtp3,${x3}1,${x3}2,${x3}3;0.24-lora,0.24-lora-mtp2,${x3}2"
  deadlines=${HXF_MC_DEADLINES:-640,380}
else
  phases="0.24,0.24-mtp1,${x3}1;0.24-mtp2,0.24-mtp3,${x3}2,${x3}3;0.24-lora,0.24-lora-mtp2,${x3}2"
  deadlines=${HXF_MC_DEADLINES:-540,380,300}
fi
echo "== mtp-compare: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), ${mem:-?} MiB: phases $phases"
export HXF_CMP_PHASES="$phases" HXF_CMP_DEADLINES="$deadlines" HXF_CMP_LEVELS=1,4,8 HXF_CMP_SEQS=8
export HXF_CMP_PROMPT=128 HXF_CMP_OUTPUT="${HXF_MC_OUTPUT:-64}" HXF_CMP_REPEATS="${HXF_MC_REPEATS:-5}"
export HXF_CMP_ACCEPT=0.63,0.85 HXF_CMP_POOLS=a63=0:250,a85=250:500
# 8 requests of 128 + 64 + 64 tokens, float32 state (49 MiB blocks; doctor/memory/arithmetic.py kv_layout): one
# attention block and, in each of the 3 state groups, 2 blocks with prefix caching (no MTP)
# and 2 + K with MTP (align mode keeps K speculative blocks a group: v1/core/single_type_kv_cache_manager.py
# MambaManager): 7, 10, 13 and 16 blocks a request, 2.7, 3.8, 5.0 and 6.1 GiB for 8; pinned with about 15 % spare
export HXF_CMP_KV_BYTES=$((13 << 28)) HXF_CMP_LORA_KV_BYTES=$((13 << 28))
export HXF_CMP_MTP_KV_BYTES=$((9 << 29)),$((23 << 28)),$((7 << 30)) HXF_CMP_EXT_WAIT=${HXF_CMP_EXT_WAIT:-900}
bash ci/gpu-run.sh 0.24 compare:qwen3.6-27b-full
