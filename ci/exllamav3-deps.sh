#!/usr/bin/env bash
# The packages exllamav3 1.6.5 imports (its METADATA) that the GPU image may lack: marisa-trie, llguidance, pydantic
# and rich, with what they need (docs/gpu-runs/2026-12-05-run27/README.md lists what the image has). The compare
# stage still puts a staged aphrodite 0.21.0 site (/tmp/devsite) first on exllamav3's PYTHONPATH where there is one;
# with these carried, exllamav3 needs none. Downloaded for the GPU image's Python (cp312, manylinux x86_64) into
# .cache/exllamav3-deps/, which ci/exllamav3-env.sh installs; carry that folder with the call that starts exllamav3.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cache/exllamav3-deps
mkdir -p "$dest"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 17 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
pip download -q "${plat[@]}" --platform manylinux2014_x86_64 -d "$dest" marisa-trie "llguidance>=1.7" pydantic rich 2>&1 | grep -v "^WARNING: Location" || true
for w in marisa_trie llguidance pydantic rich; do
  ls "$dest"/$w-*.whl > /dev/null || { echo "exllamav3-deps: could not download $w"; exit 1; }
done
du -sh "$dest"
