#!/usr/bin/env bash
# exllamav3 1.6.5's CUDA extension for SM90, built on the GPU machine against the image's own torch
# (ci/exllamav3-build.py: torch's cpp_extension JIT, 289-472 s on 16 cores: docs/gpu-runs/2026-11-30-run3/README.md), gzipped to
# /tmp/exllamav3_ext.so.gz, where ci/exllamav3-env.sh finds it. It needs no staged aphrodite, so it can start,
# detached, in the first device call and build while the staging calls follow:
#   bash ci/device-bg.sh start x3 bash ci/exllamav3-build.sh      # carry [".cache/wheels/exllamav3-1.6.5-py3-none-any.whl"]
set -uo pipefail
cd "$(dirname "$0")/.."
wheel=.cache/wheels/exllamav3-1.6.5-py3-none-any.whl out=/tmp/exllamav3_ext.so.gz
[ -e "$out" ] && { echo "exllamav3-build: $out is there already"; exit 0; }
[ -e "$wheel" ] || { echo "exllamav3-build: needs $wheel (carry it)"; exit 2; }
env -u PYTHONPATH TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS="${MAX_JOBS:-12}" TORCH_EXTENSIONS_DIR=/tmp/exl3-ext \
  nice -n 19 python3 ci/exllamav3-build.py "$wheel" || exit 1
so=$(find /tmp/exl3-ext -name 'exllamav3_ext*.so' | head -1)
[ -n "$so" ] || { echo "exllamav3-build: no exllamav3_ext*.so under /tmp/exl3-ext"; exit 1; }
gzip -c "$so" > "$out.part" && mv "$out.part" "$out" && ls -la "$out"
