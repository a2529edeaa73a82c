#!/usr/bin/env bash
# Bring one large file from the GPU machine back through $OUT in 15 MiB parts, four a call (64 MiB come back a call):
#   bash ci/device-bring.sh FILE [FIRST [COUNT]]   parts FIRST.. (default 0), COUNT of them (default 4), as
#                                                  $OUT/NAME.part-NN
# Prints the parts' count and FILE's sha256, so that the parts put together here can be checked:
#   cat NAME.part-* > NAME && sha256sum NAME
# Used for the compile caches past ci/device-collect.sh's first parts (FILE /tmp/caches.tgz) and for exllamav3's
# built extension (/tmp/exllamav3_ext.so.gz, to be carried as .cache/exllamav3-ext/ next time).
set -uo pipefail
file=${1:?usage: ci/device-bring.sh FILE [FIRST [COUNT]]} first=${2:-0} count=${3:-4}
[ -f "$file" ] || { echo "device-bring: no file $file here"; exit 2; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
name=$(basename "$file") parts=/tmp/device-bring/$name
if [ ! -e "$parts/.done" ] || [ "$file" -nt "$parts/.done" ]; then
  rm -rf "$parts"; mkdir -p "$parts"
  split -b 15M -d -a 2 "$file" "$parts/$name.part-" && touch "$parts/.done"
fi
n=$(ls "$parts" | grep -c '\.part-')
last=$((first + count - 1)); [ "$last" -lt "$n" ] || last=$((n - 1))
for k in $(seq "$first" "$last"); do
  p=$(printf '%s/%s.part-%02d' "$parts" "$name" "$k"); [ -e "$p" ] && cp "$p" "$OUT/"
done
echo "device-bring: $name $(du -h "$file" | cut -f1), $n parts; $first..$last in this call; sha256 $(sha256sum "$file" | cut -d' ' -f1)"
