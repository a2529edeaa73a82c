#!/usr/bin/env bash
# The packages exllamav3 1.6.5 imports (its METADATA) that neither the GPU image nor the staged aphrodite 0.21.0
# site (/tmp/devsite, which the compare stage puts on exllamav3's PYTHONPATH) provides: marisa-trie. Downloaded
# here for the GPU image's Python (cp312, manylinux x86_64) into .cache/exllamav3-deps/, which
# ci/exllamav3-env.sh installs; carry that folder with the call that starts exllamav3.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cache/exllamav3-deps
mkdir -p "$dest"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 17 28 34; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
pip download -q --no-deps "${plat[@]}" --platform manylinux2014_x86_64 -d "$dest" marisa-trie 2>&1 | grep -v "^WARNING: Location" || true
ls "$dest"/marisa_trie-*.whl > /dev/null || { echo "exllamav3-deps: could not download marisa-trie"; exit 1; }
du -sh "$dest"
