#!/usr/bin/env bash
# Stage aphrodite-engine 0.24.x for the GPU machine, the way
# ci/stage-0.21.sh stages 0.21.0: build the payload here, split it into parts of <= 52 MiB
# under .devstage-0.24/ (git-ignored) and print the device calls.
#
# Why it differs: 0.22.0 and later pin torch 2.13.0 and triton 3.7.1, and the GPU image has torch
# 2.11.0+cu130. So the payload carries torch 2.13.0 and triton 3.7.1 too, installed into their own
# folder in front of the image's site-packages, and what torch 2.13 and aphrodite 0.24.1 cannot take from the image
# (each seen on the GPU machine, docs/gpu-runs/2026-12-01-run14):
#   - NCCL: the image has nvidia-nccl-cu13 2.28.9; torch 2.13's libtorch_cuda.so needs ncclCommResume
#     ("undefined symbol: ncclCommResume" at `import torch`): nvidia-nccl-cu13 2.29.7 (its pin, 206 MB) is carried
#     into the torch folder, where torch's loader finds it before the image's
#   - torchvision: the image's 0.26 (for torch 2.11) makes aphrodite's import fail ("operator torchvision::nms
#     does not exist"): torchvision 0.28.0 (aphrodite 0.24.1's pin, 8 MB) is carried
# It does NOT carry the other CUDA libraries torch 2.13 pins, and relies on the image's: cuda-toolkit 13.0.2
# (pin 13.0.3), nvshmem 3.4.5 (= pin), cusparselt 0.8.0 (pin 0.8.1) load; cuDNN 9.19 (pin 9.20, about 700 MB)
# makes torch raise at the first cuDNN use ("cuDNN version incompatibility"), which the text path has not
# needed so far. The install call checks `import torch; torch.cuda.init()`, a CUDA op, torchvision's nms
# and aphrodite's compiled kernels (0.22+: aphrodite._C_stable_libtorch; there is no aphrodite._C).
#
# Usage (from the project root):  bash ci/stage-0.24.sh [0.24.1] [--dry-run]
#   --dry-run: download and split, print the sizes and the number of calls, remove nothing.
set -euo pipefail
VER="0.24.1"; DRY=0
for a in "$@"; do case "$a" in --dry-run) DRY=1 ;; *) VER="$a" ;; esac; done
ROOT="$(git rev-parse --show-toplevel)"
CACHE="${DEVSTAGE_CACHE:-$HOME/.cache/devstage}/0.24-$VER"
OUTD="$ROOT/.devstage-0.24"
# a device call carries 64 MiB with the tracked tree: parts of 52 MiB leave room for it (tests/ci/test_devstage_resplit.py checks
# that the tree and one part fit)
PART_BYTES=$((52 * 1024 * 1024))
grep -qxF '/.devstage-0.24/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.devstage-0.24/' >> "$ROOT/.git/info/exclude"
mkdir -p "$CACHE"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 17 18 24 26 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# The runtime: aphrodite itself, the torch and triton it pins, flashinfer at its pin.
CORE=("aphrodite-engine==$VER" torch==2.13.0 triton==3.7.1 flashinfer-python==0.6.18 apache-tvm-ffi==0.1.11)
# installed beside torch (see above)
TORCH_SIDE=(nvidia-nccl-cu13==2.29.7 torchvision==0.28.0)
# What 0.24.x imports on the way to serving (its METADATA's pins) that the image lacks or has in an
# older version; plus the server's extras, as stage.sh ships them for 0.21.
DEPS=(annotated-types astor blake3 cachetools cbor2 'compressed-tensors==0.17.0' 'depyf==0.20.0' dill diskcache
      distro 'fastapi>=0.133,<0.137' 'starlette>=1.0.1' gguf ijson importlib_metadata interegular jiter jsonschema
      jsonschema-specifications 'lark==1.2.2' 'llguidance>=1.7.0,<1.8.0' 'lm-format-enforcer==0.11.3' loguru
      'mistral_common>=1.11.6' msgspec nvidia-ml-py 'openai>=2,<3' 'openai-harmony>=0.0.3' opentelemetry-api
      opentelemetry-sdk opentelemetry-semantic-conventions 'outlines_core==0.2.14' partial-json-parser posix_ipc
      'prometheus-fastapi-instrumentator>=8' pybase64 pycountry 'pydantic>=2.12' pydantic-core python-json-logger
      pyzmq referencing rpds-py setproctitle sniffio typing-inspection watchfiles 'xgrammar>=0.2.1,<1'
      'model-hosting-container-standards>=0.1.14,<1' jmespath supervisor 'anthropic>=0.71' 'mcp>=2,<3'
      uvicorn httptools websockets python-multipart email-validator dnspython pydantic-extra-types)
# nvidia-cutlass-dsl[cu13]==4.6.2 (aphrodite 0.24.1's METADATA pin): FlashInfer's GDN prefill kernel, the engine's
# default --gdn-prefill-backend on SM90, imports `cutlass` at its first prefill; without it the engine stops in its
# warm-up with `ModuleNotFoundError: No module named 'cutlass'` (docs/gpu-runs/2026-12-03-run19/README.md). Its CUDA Python bindings
# (cuda-python 13.4.4's) are installed only where the image has none (the H200 image has cuda-bindings 13.3.1,
# cuda-core 1.2.0 and cuda-pathfinder 1.8.1 and no cutlass: checked 2026-12-03).
CUTLASS=(nvidia-cutlass-dsl==4.6.2 nvidia-cutlass-dsl-libs-base==4.6.2 nvidia-cutlass-dsl-libs-core==4.6.2
         nvidia-cutlass-dsl-libs-cu13==4.6.2 'nvidia-cuda-nvdisasm>=13.3,<14')
CUDA_PY=(cuda-python==13.4.4 cuda-bindings==13.4.4 'cuda-core>=1.2,<1.3' 'cuda-pathfinder>=1.1,<2')
echo "== downloading into $CACHE (cached between runs)"
[ -f "$CACHE/.core-ok" ] || { pip download -q --no-deps "${PLAT[@]}" -d "$CACHE/core" "${CORE[@]}" && touch "$CACHE/.core-ok"; }
[ -f "$CACHE/.side-ok" ] || { pip download -q --no-deps "${PLAT[@]}" -d "$CACHE/side" "${TORCH_SIDE[@]}" && touch "$CACHE/.side-ok"; } \
  || { echo "stage-0.24: could not download ${TORCH_SIDE[*]}"; exit 1; }
[ -f "$CACHE/.deps-ok" ] || { pip download -q --no-deps "${PLAT[@]}" --platform any -d "$CACHE/deps" "${DEPS[@]}" 2>/dev/null \
  || pip download -q --no-deps "${PLAT[@]}" -d "$CACHE/deps" "${DEPS[@]}"; touch "$CACHE/.deps-ok"; }
[ -f "$CACHE/.cutlass-ok" ] || { pip download -q --no-deps "${PLAT[@]}" --platform any -d "$CACHE/cutlass" "${CUTLASS[@]}" \
  && pip download -q --no-deps "${PLAT[@]}" --platform any -d "$CACHE/cutlass/cuda-python" "${CUDA_PY[@]}" \
  && touch "$CACHE/.cutlass-ok"; } || { echo "stage-0.24: could not download ${CUTLASS[*]} ${CUDA_PY[*]}"; exit 1; }
du -sh "$CACHE/core" "$CACHE/side" "$CACHE/deps" "$CACHE/cutlass"
TMP=$(mktemp -d)
tar cf "$TMP/payload.tar" -C "$CACHE" core side deps cutlass  # the wheels are compressed already
rm -rf "$OUTD"; mkdir -p "$OUTD"
split -b "$PART_BYTES" -d -a 2 "$TMP/payload.tar" "$TMP/part"
n=0
for p in "$TMP"/part*; do
  n=$((n + 1)); mkdir -p "$OUTD/$n"; mv "$p" "$OUTD/$n/chunk"
  printf '#!/usr/bin/env bash\nset -e; mkdir -p /tmp/devstage24; cp "$(dirname "$0")/chunk" /tmp/devstage24/part%02d; ls /tmp/devstage24 | wc -l\n' "$n" > "$OUTD/$n/stash.sh"
done
mkdir -p "$OUTD/install"
cat > "$OUTD/install/install.sh" <<SH
#!/usr/bin/env bash
# Reassemble the parts; torch 2.13 and triton go to /tmp/devsite24/torch (first on PYTHONPATH), aphrodite
# and its dependencies to /tmp/devsite24/site. Checks torch 2.13 against the image's CUDA libraries first.
# The PYTHONPATH every later call needs is written to /tmp/devsite24/pythonpath (ci/gpu-run.sh reads it): torch,
# site, and site/nvidia_cutlass_dsl/dsl_packages, the folder that nvidia-cutlass-dsl's .pth file puts on sys.path in
# a real site-packages. Python reads .pth files only in site folders, not in PYTHONPATH folders, so without it
# `import cutlass` fails in a --target install (docs/gpu-runs/2026-12-03-run20/README.md).
set -euo pipefail
have=\$(ls /tmp/devstage24/part* 2>/dev/null | wc -l)
[ "\$have" -eq $n ] || { echo "devstage24: \$have of $n parts here: the machine went cold; start again from part 1"; exit 3; }
rm -rf /tmp/devsite24 /tmp/devpayload24; mkdir -p /tmp/devsite24/torch /tmp/devsite24/site /tmp/devpayload24
cat \$(ls /tmp/devstage24/part* | sort) | tar xf - -C /tmp/devpayload24
pip() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "\$@"; }
pip --target /tmp/devsite24/torch /tmp/devpayload24/core/torch-*.whl /tmp/devpayload24/core/triton-*.whl /tmp/devpayload24/side/*.whl
PYTHONPATH=/tmp/devsite24/torch python3 -c "import torch, torchvision; torch.cuda.init(); x = torch.ones(4, device='cuda'); torch.ops.torchvision.nms; print('devstage24: torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0), 'sum', float(x.sum()), 'nccl', torch.cuda.nccl.version(), 'torchvision', torchvision.__version__)"
pip --target /tmp/devsite24/site \$(ls /tmp/devpayload24/core/*.whl | grep -v -e /torch- -e /triton-) /tmp/devpayload24/deps/*.whl /tmp/devpayload24/cutlass/*.whl
echo /tmp/devsite24/torch:/tmp/devsite24/site:/tmp/devsite24/site/nvidia_cutlass_dsl/dsl_packages > /tmp/devsite24/pythonpath
PYTHONPATH=\$(cat /tmp/devsite24/pythonpath) python3 -c "import cuda.bindings" 2>/dev/null || pip --target /tmp/devsite24/site /tmp/devpayload24/cutlass/cuda-python/*.whl
rm -rf /tmp/devpayload24 /tmp/devstage24
mkdir -p /tmp/devsite24/bin
printf '#!/usr/bin/env python3\\nimport sys\\nfrom aphrodite.entrypoints.cli.main import main\\nif __name__ == "__main__":\\n    sys.exit(main())\\n' > /tmp/devsite24/bin/aphrodite
chmod +x /tmp/devsite24/bin/aphrodite
export PYTHONPATH=\$(cat /tmp/devsite24/pythonpath)
python3 -c "import aphrodite, torch, aphrodite._C_stable_libtorch; print('devstage24: aphrodite', aphrodite.__version__, 'torch', torch.__version__, '(kernels load)')"
python3 -c "import cutlass; print('devstage24: cutlass', cutlass.__version__ if hasattr(cutlass, '__version__') else '(imports)')" 2>&1 | tail -1
echo "devstage24: ready. Later calls: export PYTHONPATH=\$PYTHONPATH PATH=/tmp/devsite24/bin:\\\$PATH APHRODITE_NO_USAGE_STATS=1"
SH
chmod +x "$OUTD"/*/*.sh
total=$(du -sb "$TMP/payload.tar" | cut -f1); rm -rf "$TMP"
echo "== $n parts ($((total / 1048576)) MiB) in .devstage-0.24/: $n stash calls, then the install call"
[ "$DRY" = 1 ] && exit 0
for k in $(seq 1 $n); do echo "   run(command='bash .devstage-0.24/$k/stash.sh', carry=['.devstage-0.24/$k'])"; done
echo "   run(command='bash .devstage-0.24/install/install.sh && <your command>', carry=['.devstage-0.24/install'])"
