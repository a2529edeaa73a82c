#!/usr/bin/env bash
# Install this project into a staged aphrodite site: bash ci/site-install.sh TARGET (from the project root).
# `pip install --target` replaces every top-level folder of TARGET that the project also ships, bin/ among them,
# and with it the staged release's `aphrodite` console script (ci/stage-0.21.sh writes /tmp/devsite/bin/aphrodite),
# after which tests/gpu/server.py falls back to `python3 -m aphrodite.entrypoints.cli.main` (docs/gpu-runs/2026-12-03-run19/README.md). The script is kept aside and put back.
set -uo pipefail
target=${1:?usage: ci/site-install.sh TARGET}
saved=""
if [ -e "$target/bin/aphrodite" ]; then saved=$(mktemp); cp -p "$target/bin/aphrodite" "$saved"; fi
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target "$target" . 2>&1 \
  | grep -v "^WARNING: Target" | tail -3
if [ -n "$saved" ]; then mkdir -p "$target/bin"; cp -p "$saved" "$target/bin/aphrodite"; rm -f "$saved"; fi
