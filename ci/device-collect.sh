#!/usr/bin/env bash
# Bring one gpu-run.sh run back through $OUT (8 files, 16 MiB each, 64 MiB in all come back):
#   bash ci/device-collect.sh RELEASE [JOB]
# results.tgz: RESULTS (/tmp/hxf-out/RELEASE) without checkpoints, every log and JSON under the stages' work
# folders (/tmp/hxf-gpu-RELEASE-*), the job's log; caches.tgz.part-NN: the compile caches this run left (aphrodite's
# torch_compile_cache, the Triton cache, FlashInfer's JIT cache), one gzipped tar split into 15 MiB parts, the
# first three back (caches.txt lists each cache's size, the parts' count and the tar's sha256; the further parts:
# `bash ci/device-bring.sh /tmp/caches.tgz 3`), to be carried into a later run; HXF_COLLECT_CACHES=0 leaves them out.
set -uo pipefail
REL=${1:?usage: ci/device-collect.sh RELEASE [JOB]} JOB=${2:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
list=$(mktemp)
{ find "/tmp/hxf-out/$REL" -type f ! -name '*.safetensors'
  find /tmp/hxf-gpu-"$REL"-* -type f \( -name '*.log' -o -name '*.json' -o -name '*.txt' -o -name '*.xml' \) 2>/dev/null
  [ -n "$JOB" ] && ls /tmp/hxf-bg/"$JOB".* 2>/dev/null
} > "$list"
tar czf "$OUT/results.tgz" -T "$list" 2>/dev/null; ls -la "$OUT/results.tgz"
caches=""
[ "${HXF_COLLECT_CACHES:-1}" = 0 ] || caches=$( { find / -xdev -type d \( -name torch_compile_cache -o -path '*/.cache/flashinfer' \) -prune 2>/dev/null
            ls -d "/tmp/hxf-triton-$REL" 2>/dev/null; } | sort -u)
{ for c in $caches; do du -sh "$c"; done; } > "$OUT/caches.txt"
if [ -n "$caches" ]; then  # the first three parts here (with results.tgz, under 64 MiB); the rest by ci/device-bring.sh
  tar czf /tmp/caches.tgz $caches 2>/dev/null
  OUT="$OUT" bash ci/device-bring.sh /tmp/caches.tgz 0 3 >> "$OUT/caches.txt"
fi
cat "$OUT/caches.txt"
