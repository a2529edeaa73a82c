#!/usr/bin/env bash
# The 27B at full depth against exllamav3 at matched GDN state, both ways, in one device call: aphrodite 0.24.1's
# default (the published config's float32 state) beside exllamav3 with a float32 recurrent state, and aphrodite with
# --mamba-ssm-cache-dtype bfloat16 beside exllamav3's default float16 state (2 bytes a value each), levels 1, 8, 16,
# 32, 64 with every request of a level active at once (bench/level_checks.py), 5 repeats. Run detached after
# 0.24.1's install call:
#   bash ci/device-bg.sh start r53 bash ci/stages/compare-state.sh
# and waited for with the results brought back in every call (docs/development.md), a machine lost between two calls
# keeping what was measured:
#   bash ci/device-bg.sh wait r53 290 /tmp/hxf-out/0.24/compare.log /tmp/hxf-out/0.24/compare/*.json
# The four engines hold about 124 GiB at N = 64 (aphrodite: 12 GiB of weights and a 22.5 / 11.5 GiB pool pinned for
# 64 requests of 256 tokens; exllamav3: the same weights and two state rows a slot, 18 / 9 GiB at 64 slots): on a GPU
# of 120 GiB or more they run as one phase, on an 80 GB card as two (each state pair a phase of its own, so that
# every ratio is of two engines alternated in one phase). Settings (defaults for one device budget):
#   HXF_CS_LEVELS (1,8,16,32,64), HXF_CS_PROMPT / HXF_CS_OUTPUT (128 / 64 tokens), HXF_CS_REPEATS (5),
#   HXF_CS_DEADLINES (seconds from each phase's start after which no level starts: 950 for one phase, 780,520 for two)
set -uo pipefail
cd "$(dirname "$0")/../.."
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ "${mem:-0}" -ge 122880 ]; then
  phases="0.24,0.24-bf16state,exllamav3-fp32,exllamav3" deadlines=${HXF_CS_DEADLINES:-950}
else
  phases="0.24,exllamav3-fp32;0.24-bf16state,exllamav3" deadlines=${HXF_CS_DEADLINES:-780,520}
fi
echo "== compare-state: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), ${mem:-?} MiB: phases $phases"
export HXF_CMP_PHASES="$phases" HXF_CMP_DEADLINES="$deadlines" HXF_CMP_LEVELS="${HXF_CS_LEVELS:-1,8,16,32,64}"
export HXF_CMP_PROMPT="${HXF_CS_PROMPT:-128}" HXF_CMP_OUTPUT="${HXF_CS_OUTPUT:-64}" HXF_CMP_REPEATS="${HXF_CS_REPEATS:-5}"
# 64 requests of 128 + 64 + 64 tokens (same_run.py's --max-model-len): 7 blocks a request in 0.24.1's hybrid pool
# with prefix caching (1 attention block + 3 state groups x 2; doctor/memory/arithmetic.py kv_layout): 21.4 GiB with the float32
# state (49 MiB blocks), 10.9 GiB with bfloat16 (24.5 MiB); pinned with about 5 % to spare
export HXF_CMP_KV_BYTES=$((45 << 29)) HXF_CMP_BF16_KV_BYTES=$((23 << 29)) HXF_CMP_EXT_WAIT=${HXF_CMP_EXT_WAIT:-900}
bash ci/gpu-run.sh 0.24 compare:qwen3.6-27b-full
