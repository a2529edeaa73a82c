#!/usr/bin/env bash
# Stage a real aphrodite-engine install for the GPU machine reached through the `device` tool.
#
# Why: the GPU machine has no package registry and each `run` call carries at most 64 MiB,
# while aphrodite-engine 0.21.0 is a ~250 MB wheel plus ~90 MB of dependency wheels.
# This script builds the payload here, split into parts of <= 60 MiB under .devstage/ in the
# current repository (git-ignored), and prints the exact run() calls to make.
#
# Usage (from the project root):   bash ci/stage-0.21.sh [APHRODITE_VERSION]
# Parts of 52 MiB, so that one fits a device call beside the tracked tree.
#   APHRODITE_VERSION: 0.21.0 (default) or 0.20.0. Both pin torch==2.11.0, which is exactly
#   the torch on the GPU image (2.11.0+cu130, Python 3.12, transformers 5.17, peft 0.21).
#   0.22.0 and later pin torch 2.13 and cannot run there; test them on the CPU only.
#
# What it leaves out: the FlashAttention-2 extension (_vllm_fa2_C, 191 MB); the FA3 one is kept,
# which is what an H200 uses. Pick attention_backend="TRITON_ATTN" or the default.
set -euo pipefail
VER="${1:-0.21.0}"
ROOT="$(git rev-parse --show-toplevel)"
CACHE="${DEVSTAGE_CACHE:-$HOME/.cache/devstage}"
OUTD="$ROOT/.devstage"
PART_BYTES=$((52 * 1024 * 1024))  # beside the tracked tree, a part must leave room in one 64 MiB call
grep -qxF '/.devstage/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.devstage/' >> "$ROOT/.git/info/exclude"
mkdir -p "$CACHE/wheels-$VER"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64
      --platform manylinux_2_5_x86_64)
# Dependencies of aphrodite-engine 0.20/0.21 that the GPU image lacks, with pins that import cleanly
# next to its torch 2.11 / transformers 5.17 (openai 3.x needs httpx2; xgrammar 0.2.x needs a newer
# apache-tvm-ffi than aphrodite pins; fastapi >= 0.160 imports opentelemetry). The last line is what
# `aphrodite run` (the OpenAI server) needs beyond the engine: fastapi[standard]'s uvicorn and friends,
# and mistral_common's pydantic-extra-types (its import chain reaches the server's tool parsers).
DEPS=(annotated-types apache-tvm-ffi==0.1.9 astor blake3 cachetools cbor2 compressed-tensors==0.15.0.1
      depyf==0.20.0 dill diskcache==5.6.3 distro fastapi flashinfer-python==0.6.8.post1 gguf ijson
      importlib_metadata interegular jiter jsonschema jsonschema-specifications lark==1.2.2
      'llguidance>=1.3.0,<1.4.0' lm-format-enforcer==0.11.3 loguru mistral_common msgspec nvidia-ml-py
      'openai>=2,<3' openai-harmony opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
      outlines_core==0.2.14 partial-json-parser posix_ipc prometheus-fastapi-instrumentator pybase64
      pycountry pydantic pydantic-core python-json-logger pyzmq referencing rpds-py setproctitle sniffio
      starlette typing-inspection watchfiles xgrammar==0.1.33
      uvicorn httptools websockets python-multipart email-validator dnspython pydantic-extra-types)
echo "== downloading wheels into $CACHE (cached between runs)"
[ -f "$CACHE/aphrodite-$VER.ok" ] || { pip download -q --no-deps -d "$CACHE" "aphrodite-engine==$VER" && touch "$CACHE/aphrodite-$VER.ok"; }
[ -f "$CACHE/wheels-$VER/.ok" ] || { pip download -q --no-deps "${PLAT[@]}" -d "$CACHE/wheels-$VER" "${DEPS[@]}" && touch "$CACHE/wheels-$VER/.ok"; }
WHL=$(ls "$CACHE"/aphrodite_engine-"$VER"-*.whl)
echo "== building payload"
TMP=$(mktemp -d)
mkdir -p "$TMP/payload/site"
python3 - "$WHL" "$TMP/payload/site" <<'PY'
import sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        if info.filename.endswith("_vllm_fa2_C.abi3.so"):
            continue
        z.extract(info, dest)
PY
cp "$CACHE/wheels-$VER"/*.whl "$TMP/payload/"
tar czf "$TMP/payload.tgz" -C "$TMP/payload" .
rm -rf "$OUTD"; mkdir -p "$OUTD"
split -b "$PART_BYTES" -d -a 1 "$TMP/payload.tgz" "$TMP/part"
n=0
for p in "$TMP"/part*; do
  n=$((n + 1)); mkdir -p "$OUTD/$n"; mv "$p" "$OUTD/$n/chunk"
  cat > "$OUTD/$n/stash.sh" <<SH
#!/usr/bin/env bash
# Copy this part to the device's /tmp, where it survives between calls while the machine stays warm.
set -e; mkdir -p /tmp/devstage; cp "\$(dirname "\$0")/chunk" /tmp/devstage/part$n; ls -l /tmp/devstage
SH
done
mkdir -p "$OUTD/install"
cat > "$OUTD/install/install.sh" <<SH
#!/usr/bin/env bash
# Reassemble the parts and install aphrodite-engine $VER and its missing dependencies into /tmp/devsite.
set -euo pipefail
have=\$(ls /tmp/devstage/part* 2>/dev/null | wc -l)
[ "\$have" -eq $n ] || { echo "devstage: \$have of $n parts on this machine: it went cold between calls; start again from part 1"; exit 3; }
rm -rf /tmp/devsite /tmp/devpayload; mkdir -p /tmp/devsite /tmp/devpayload
cat \$(ls /tmp/devstage/part* | sort -V) | tar xzf - -C /tmp/devpayload
cp -a /tmp/devpayload/site/. /tmp/devsite/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/devsite /tmp/devpayload/*.whl
rm -rf /tmp/devpayload /tmp/devstage
# The wheel was unpacked, not pip-installed, so its console script is written here; the guard matters:
# the engine's spawned processes re-import the main module.
mkdir -p /tmp/devsite/bin
printf '#!/usr/bin/env python3\\nimport sys\\nfrom aphrodite.entrypoints.cli.main import main\\nif __name__ == "__main__":\\n    sys.exit(main())\\n' > /tmp/devsite/bin/aphrodite
chmod +x /tmp/devsite/bin/aphrodite
PYTHONPATH=/tmp/devsite python3 -c "import aphrodite, torch; print('devstage: aphrodite', aphrodite.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
echo "devstage: ready. In every later call: export PYTHONPATH=/tmp/devsite PATH=/tmp/devsite/bin:\$PATH APHRODITE_NO_USAGE_STATS=1"
SH
chmod +x "$OUTD"/*/*.sh
rm -rf "$TMP"
echo "== $n parts in .devstage/ ($(du -sh "$OUTD" | cut -f1)). Make these device run() calls back to back"
echo "   (the machine is given back 30 s after a call ends; if install.sh says it went cold, start again):"
for k in $(seq 1 $n); do
  echo "   run(command='bash .devstage/$k/stash.sh', carry=['.devstage/$k'])"
done
echo "   run(command='bash .devstage/install/install.sh && export PYTHONPATH=/tmp/devsite APHRODITE_NO_USAGE_STATS=1 && <your command>', carry=['.devstage/install'])"
echo "   Later calls on the same warm machine need only: export PYTHONPATH=/tmp/devsite PATH=/tmp/devsite/bin:\$PATH APHRODITE_NO_USAGE_STATS=1"
echo '   "aphrodite run" is /tmp/devsite/bin/aphrodite. A project installed with pip --target /tmp/devsite gets no console'
echo '   script there (bin/ exists): call its CLI as python3 -m <module> or write a guarded wrapper the same way.'
