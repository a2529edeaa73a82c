#!/usr/bin/env bash
# Re-split ci/stage-0.21.sh's .devstage/ into parts that fit one device call beside this repository.
#
# Why: a device call carries 64 MiB in all, the tracked tree included, and a staging of 60 MiB parts leaves no room
# for the tree (the device tool refuses such a call). Same payload, smaller parts, scripts rewritten to match
# (stash.sh per part; install.sh's part count).
# Usage (from the project root, after stage.sh):  bash ci/devstage-resplit.sh [MiB, default 52]
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
MIB="${1:-52}"
parts=$(ls -d .devstage/[0-9]* 2>/dev/null | sort -V || true)
[ -n "$parts" ] && [ -e .devstage/install/install.sh ] || { echo "no .devstage/ here: run ci/stage-0.21.sh first"; exit 2; }
old=$(echo "$parts" | wc -l)
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
for d in $parts; do cat "$d/chunk"; done > "$TMP/payload"
before=$(md5sum < "$TMP/payload")
split -b $((MIB * 1024 * 1024)) -d -a 2 "$TMP/payload" "$TMP/part"
rm -rf $parts
n=0
for p in "$TMP"/part*; do
  n=$((n + 1)); mkdir -p ".devstage/$n"; mv "$p" ".devstage/$n/chunk"
  printf '#!/usr/bin/env bash\n# Copy this part to the device'"'"'s /tmp, where it survives between calls while the machine stays warm.\nset -e; mkdir -p /tmp/devstage; cp "$(dirname "$0")/chunk" /tmp/devstage/part%d; ls -l /tmp/devstage\n' "$n" \
    > ".devstage/$n/stash.sh"
  chmod +x ".devstage/$n/stash.sh"
done
sed -i "s/-eq $old \]/-eq $n ]/; s/of $old parts/of $n parts/" .devstage/install/install.sh
grep -q -- "-eq $n ]" .devstage/install/install.sh || { echo "install.sh's part count was not $old: check it by hand"; exit 3; }
after=$(for k in $(seq 1 $n); do cat ".devstage/$k/chunk"; done | md5sum)
[ "$before" = "$after" ] || { echo "the payload changed while re-splitting"; exit 3; }
echo "== .devstage/: $old parts -> $n parts of <= $MIB MiB (payload unchanged): $n stash calls, then the install call"
