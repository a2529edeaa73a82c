#!/usr/bin/env bash
# Source on the GPU machine (issue 9): exllamav3 1.6.5 importable without a build, from what the
# device call carries: its wheel (.cache/wheels/exllamav3-1.6.5-py3-none-any.whl, from `make
# install`), the extension ci/exllamav3-build.py built (.cache/exllamav3-ext/exllamav3_ext.so.gz),
# and the pure-Python dependencies the GPU image lacks (.whl/: marisa-trie, pydantic and its parts).
#   source ci/exllamav3-env.sh; python3 ci/exllamav3-oracle.py read WORK
EXL3_ROOT="${EXL3_ROOT:-/tmp/exl3}"
mkdir -p "$EXL3_ROOT/bin" "$EXL3_ROOT/src" "$EXL3_ROOT/site"
[ -e "$EXL3_ROOT/bin/exllamav3_ext.so" ] || gunzip -c .cache/exllamav3-ext/exllamav3_ext.so.gz > "$EXL3_ROOT/bin/exllamav3_ext.so"
[ -e "$EXL3_ROOT/src/exllamav3" ] || python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
  .cache/wheels/exllamav3-1.6.5-py3-none-any.whl "$EXL3_ROOT/src"
[ -e "$EXL3_ROOT/site/.ok" ] || { python3 -m pip install -q --no-index --no-deps --target "$EXL3_ROOT/site" .whl/*.whl && touch "$EXL3_ROOT/site/.ok"; }
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$EXL3_ROOT/bin:$EXL3_ROOT/src:$EXL3_ROOT/site"
