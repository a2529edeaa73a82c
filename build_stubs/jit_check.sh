#!/usr/bin/env bash
# Issue 5 on a GPU host: flashinfer's JIT link with a conda-like CUDA_HOME, before and after
# `hybrid-exl3-fixes stubs`. Usage: bash build_stubs/jit_check.sh [WORKDIR]  (PYTHONPATH must
# reach flashinfer, torch and this project). Prints the record; exit 0 when "before" fails with
# `cannot find -lcuda` and "after" builds and runs the kernel.
#
# The fake prefix mimics conda-forge CUDA: bin/, nvvm/, include/ of the real toolkit, libcudart in
# lib/, the driver stub in lib/stubs/ -- and no lib64/, so flashinfer's `-L$CUDA_HOME/lib64/stubs
# -lcuda` finds nothing (the WSL2 report). The compiler finds lib/ through LIBRARY_PATH, as a conda
# environment's compiler finds $PREFIX/lib.
set -uo pipefail
W="${1:-/tmp/hxf-jit}"
rm -rf "$W"; mkdir -p "$W"
REAL="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
F="$W/conda-prefix"
mkdir -p "$F/lib/stubs"
for d in bin nvvm include; do ln -s "$REAL/$d" "$F/$d"; done
for lib in "$REAL"/lib64/libcudart.so* "$REAL"/targets/x86_64-linux/lib/libcudart.so*; do
  [ -e "$lib" ] && ln -sf "$lib" "$F/lib/"
done
stub=$(ls "$REAL"/lib64/stubs/libcuda.so "$REAL"/targets/x86_64-linux/lib/stubs/libcuda.so 2>/dev/null | head -1)
[ -n "$stub" ] && cp "$stub" "$F/lib/stubs/libcuda.so"
echo "== toolkit $REAL; fake conda prefix $F (stub copied from: ${stub:-none})"
echo "== the system linker's own libcuda.so: $(gcc -print-file-name=libcuda.so)  (a bare name = not found)"
echo "== driver: $(ldconfig -p | grep 'libcuda.so.1 ' | head -1)"

KERNEL='
import time, torch, flashinfer
x = torch.randn(8, 512, dtype=torch.float16, device="cuda")
t = time.time()
y = flashinfer.activation.silu_and_mul(x)
ref = torch.nn.functional.silu(x[:, :256].float()) * x[:, 256:].float()
print(f"JIT build + run {time.time() - t:.1f} s; max |flashinfer - torch| = {(y.float() - ref).abs().max().item():.2e}")
assert (y.float() - ref).abs().max().item() < 1e-2
import glob, subprocess
so = glob.glob(str(__import__("flashinfer.jit.env", fromlist=["x"]).FLASHINFER_JIT_DIR) + "/**/*.so", recursive=True)[0]
print(subprocess.run(["sh", "-c", f"readelf -d {so} | grep NEEDED | grep -i cuda; ldd {so} | grep libcuda"], capture_output=True, text=True).stdout)
'
export CUDA_HOME="$F" LIBRARY_PATH="$F/lib${LIBRARY_PATH:+:$LIBRARY_PATH}" FLASHINFER_WORKSPACE_BASE="$W/ws"
unset FLASHINFER_EXTRA_LDFLAGS CUDA_PATH

echo; echo "== before: CUDA_HOME=$F, no stubs folder of ours"
before=$(python3 -c "$KERNEL" 2>&1); rc_before=$?
echo "$before" | grep -E "cannot find -lcuda|JIT build|Error|error:" | head -8
echo "exit $rc_before"

echo; echo "== hybrid-exl3-fixes stubs --out $W/stubs"
python3 -m hybrid_exl3_fixes.cli stubs --out "$W/stubs"; rc_stubs=$?
cat "$W/stubs/env.sh" 2>/dev/null

echo; echo "== after: source $W/stubs/env.sh"
# shellcheck disable=SC1091
source "$W/stubs/env.sh"
after=$(python3 -c "$KERNEL" 2>&1); rc_after=$?
echo "$after" | tail -6
echo "exit $rc_after"

echo "$before" | grep -q "cannot find -lcuda" && [ "$rc_before" -ne 0 ] && [ "$rc_stubs" -eq 0 ] && [ "$rc_after" -eq 0 ]
