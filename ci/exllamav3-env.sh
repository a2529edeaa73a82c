#!/usr/bin/env bash
# Source on the GPU machine: exllamav3 1.6.5 importable without a build, from what the
# device call carries: its wheel (.cache/wheels/exllamav3-1.6.5-py3-none-any.whl, from `make
# install`), the extension (.cache/exllamav3-ext/exllamav3_ext.so.gz carried, or /tmp/exllamav3_ext.so.gz from
# ci/exllamav3-build.sh on this machine) and the dependencies the GPU image lacks (ci/exllamav3-deps.sh).
#   source ci/exllamav3-env.sh; python3 ci/exllamav3-oracle.py read WORK
EXL3_ROOT="${EXL3_ROOT:-/tmp/exl3}"
mkdir -p "$EXL3_ROOT/bin" "$EXL3_ROOT/src" "$EXL3_ROOT/site"
# the extension: carried (.cache/exllamav3-ext/), else built on this machine by ci/exllamav3-build.sh
EXL3_EXT_GZ=.cache/exllamav3-ext/exllamav3_ext.so.gz; [ -e "$EXL3_EXT_GZ" ] || EXL3_EXT_GZ=/tmp/exllamav3_ext.so.gz
# (a missing extension is left for a later source of this file: the PYTHONPATH below is the same either way)
if [ ! -e "$EXL3_ROOT/bin/exllamav3_ext.so" ] && [ -e "$EXL3_EXT_GZ" ]; then
  gunzip -c "$EXL3_EXT_GZ" > "$EXL3_ROOT/bin/exllamav3_ext.so.part" && mv "$EXL3_ROOT/bin/exllamav3_ext.so.part" "$EXL3_ROOT/bin/exllamav3_ext.so"
fi
[ -e "$EXL3_ROOT/src/exllamav3" ] || python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
  .cache/wheels/exllamav3-1.6.5-py3-none-any.whl "$EXL3_ROOT/src"
# its pure-Python dependencies the image lacks: ci/exllamav3-deps.sh's wheels (or a carried .whl/ folder)
[ -e "$EXL3_ROOT/site/.ok" ] || { python3 -m pip install -q --no-index --no-deps --target "$EXL3_ROOT/site" \
  $(ls .cache/exllamav3-deps/*.whl .whl/*.whl 2>/dev/null) && touch "$EXL3_ROOT/site/.ok"; }
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$EXL3_ROOT/bin:$EXL3_ROOT/src:$EXL3_ROOT/site"
