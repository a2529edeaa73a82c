#!/usr/bin/env bash
# Write one make-tiny checkpoint unless a finished one is there (make-tiny writes atomically), one writer per folder:
#   bash ci/make-model.sh DIR MAKE-TINY-ARGS...
# A second caller (ci/gpu-run.sh's stage, while a checkpoint started in an earlier device call is still being written)
# waits on DIR.lock for the first and then finds its manifest, instead of writing the same 14 GiB beside it.
set -uo pipefail
dir=${1:?usage: ci/make-model.sh DIR MAKE-TINY-ARGS...}; shift
mkdir -p "$(dirname "$dir")"
lock=(flock "$dir.lock"); command -v flock > /dev/null || { echo "make-model: no flock here: no lock"; lock=(); }
exec "${lock[@]}" bash -c '
  if [ -e "$1/manifest.json" ]; then echo "make-model: $1 is written already"; exit 0; fi
  /usr/bin/time -f "make-tiny $1: %e s" python3 -m hybrid_exl3_fixes.cli make-tiny "$@"' _ "$dir" "$@"
