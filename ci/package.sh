#!/usr/bin/env bash
# The package as users get it: build the sdist and the wheel, `twine check` them, install the wheel
# into a clean virtualenv (nothing else in it) and ask the installed distribution for its console
# script and its aphrodite.general_plugins entry point.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m build --no-isolation --sdist --wheel --outdir "$work/dist" . > "$work/build.log" 2>&1 ||
  { tail -30 "$work/build.log"; echo "package: build failed" >&2; exit 1; }
"$PY" -m twine check --strict "$work"/dist/*
"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-index --no-deps "$work"/dist/hybrid_exl3_fixes-*.whl
version=$("$work/venv/bin/hybrid-exl3-fixes" --version)
"$work/venv/bin/python" - "$version" <<'PY'
import importlib.metadata as md
import sys

eps = [ep for ep in md.entry_points(group="aphrodite.general_plugins") if ep.name == "hybrid_exl3_fixes"]
assert eps and eps[0].value == "hybrid_exl3_fixes:register", eps
assert eps[0].load().__module__ == "hybrid_exl3_fixes"  # importable with nothing else installed
scripts = [ep for ep in md.entry_points(group="console_scripts") if ep.name == "hybrid-exl3-fixes"]
assert scripts and scripts[0].value == "hybrid_exl3_fixes.cli:main", scripts
assert sys.argv[1] == f"hybrid-exl3-fixes {md.version('hybrid-exl3-fixes')}", sys.argv[1]
print(f"package: {sys.argv[1]}: wheel and sdist pass twine check; a clean venv has the console script "
      "and the aphrodite.general_plugins entry point")
PY
# without aphrodite the overlay says so and exits 0
"$work/venv/bin/hybrid-exl3-fixes" status | tail -2
