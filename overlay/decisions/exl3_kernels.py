"""How Aphrodite's compiled EXL3 GEMM picks its kernel, and the plan that keeps mixed codebooks right.

Torch-free, so ``status`` and the CPU tests use it without a GPU. Facts read from the wheels'
binaries (``objdump -d`` of ``aphrodite/_C.abi3.so``; docs/upstream/exl3-gemm-codebook-cache.md
has the listing and the commands):

* 0.20.0 and 0.21.0: ``exl3_gemm_gr`` (the op behind ``ops.exl3_gemm``, which
  ``_exl3_linear_one`` uses for <= 32 rows) calls ``select_exl3_gemm_mgemm_kernel_new``. That
  function caches its choice in ``_tuning_cache`` under
  ``size_k << 40 | size_n << 16 | cc << 8 | K << 4 | c_fp32`` -- no codebook -- and stores the
  kernel pointer of the codebook of the *first* call. Every later call with the same
  ``(size_k, size_n, K)`` on a device of the same compute class launches that kernel.
  Upstream source: csrc/quantization/exl3/exllamav3_ext/quant/exl3_kernel_map.cu.
* With ``force_shape_idx > 0`` and ``force_num_sms > 0`` the same function skips the cache and
  takes the kernel for the caller's codebook (``get_gemm_kernel_ptr(K, shape, c_fp32, cb)``).
* ``exl3_mgemm`` (fused gate/up and k/v at <= 32 rows) calls ``select_exl3_mgemm_kernel``,
  which has no cache and takes the codebook: unaffected.
* 0.22.0 (``_C_fork.abi3.so``) and 0.23.0 (``_C_stable_libtorch.abi3.so``) still have the
  codebook-blind ``select_exl3_gemm_mgemm_kernel_new``; 0.24.0 replaced the cache with an
  autotuner keyed by
  ``gemm_autotune_hash(size_m, size_k, size_n, K, c_fp32, device, cc, max_num_sms, cb)``.
"""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

# Aphrodite sends at most this many rows to exl3_gemm (_exl3_linear_one); more rows take
# exl3_reconstruct + exl3_hgemm, which is right for every codebook.
SMALL_BATCH_ROWS = 32

# Extension modules that may hold the EXL3 kernels (0.20/0.21: _C; 0.22: _C_fork; 0.23+: _C_stable_libtorch).
KERNEL_MODULES = ("aphrodite._C", "aphrodite._C_fork", "aphrodite._C_stable_libtorch")
CODEBOOK_BLIND = "codebook-blind"
CODEBOOK_KEYED = "codebook-keyed"
UNKNOWN_DISPATCH = "unknown-dispatch"
# select_exl3_gemm_mgemm_kernel_new(int cc, int m, int k, int n, int K, bool c_fp32,
#                                   int force_shape_idx, int force_num_sms, int cb)
BLIND_SYMBOL = b"_Z33select_exl3_gemm_mgemm_kernel_newiiiiibiii"
# gemm_autotune_hash(int m, int k, int n, int K, bool c_fp32, int device, int cc, int sms, int cb)
KEYED_SYMBOL = b"_Z18gemm_autotune_hashiiiibiiii"

# EXL3_GEMM_TILESIZE_K / _N of exl3_kernel_map.cuh, index = shape_idx (0 unused); the same
# numbers are the exl3_gemm_tilesize_k/_n arrays in 0.21.0's _C.abi3.so .data section.
TILE_K = (0, 16, 32, 32, 16)
TILE_N = (0, 128, 128, 256, 512)


class KernelLibraryError(Exception):
    """The kernel library is there but is not an ELF file this module can read."""


def dynamic_strings(path: str | Path) -> bytes:
    """The ``.dynstr`` section of a 64-bit little-endian ELF shared object (0.5 MB for 0.21's
    _C.abi3.so, read without loading the library or touching the rest of its 97 MB)."""
    with open(path, "rb") as f:
        header = f.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            raise KernelLibraryError(f"{path} is not a 64-bit little-endian ELF file")
        (shoff,) = struct.unpack_from("<Q", header, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", header, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQII", table, i * shentsize) for i in range(shnum)]
        for _name, sh_type, _flags, _addr, _offset, _size, link, _info in sections:
            if sh_type == 11:  # SHT_DYNSYM; sh_link names its string table
                strtab = sections[link]
                f.seek(strtab[4])
                return f.read(strtab[5])
    raise KernelLibraryError(f"{path} has no dynamic symbol table")


def classify_library(path: str | Path) -> str | None:
    """CODEBOOK_BLIND, CODEBOOK_KEYED, UNKNOWN_DISPATCH (EXL3 GEMM code, neither known dispatch),
    or None when the library holds no EXL3 GEMM at all."""
    names = dynamic_strings(path)
    if b"\0" + BLIND_SYMBOL + b"\0" in names:
        return CODEBOOK_BLIND
    if b"\0" + KEYED_SYMBOL + b"\0" in names:
        return CODEBOOK_KEYED
    return UNKNOWN_DISPATCH if b"exl3_gemm" in names else None


# The EXL3 MoE kernel's refusal, as each release's kernel library spells it (read from the wheels):
# 0.20.0 - 0.23.0 take mcg only, 0.24.0 and 0.24.1 mcg and mul1.
MOE_RULES = {
    b"MoE kernel: Only mcg codebook is currently supported": frozenset({"mcg"}),
    b"MoE kernel: Only mcg and mul1 codebooks are supported": frozenset({"mcg", "mul1"}),
}


def moe_codebooks(libraries: list[Path]) -> tuple[frozenset[str] | None, str]:
    """The codebooks the installed EXL3 MoE kernel takes, read from its own error message in the
    library (a memory-mapped scan, ~0.1 s), and where that came from; None when no library says."""
    import mmap

    for lib in libraries:
        try:
            with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                for message, codebooks in MOE_RULES.items():
                    if data.find(message) >= 0:
                        return codebooks, f'{lib.name}: "{message.decode()}"'
        except (OSError, ValueError):
            continue
    return None, "no installed kernel library states the EXL3 MoE kernel's codebooks"


def installed_kernel_libraries() -> list[Path]:
    """The compiled extension files of the importable aphrodite (found, not loaded)."""
    found = []
    for name in KERNEL_MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin and Path(spec.origin).is_file():
            found.append(Path(spec.origin))
    return found


def classify_build(libraries: list[Path]) -> tuple[str | None, str]:
    """(verdict, evidence) for the EXL3 GEMM of these libraries: CODEBOOK_BLIND, CODEBOOK_KEYED,
    UNKNOWN_DISPATCH, or None with no EXL3 GEMM in any of them (or no libraries at all)."""
    for lib in libraries:
        verdict = classify_library(lib)
        if verdict in (CODEBOOK_BLIND, CODEBOOK_KEYED):
            return (
                verdict,
                f"{lib.name} defines {(BLIND_SYMBOL if verdict == CODEBOOK_BLIND else KEYED_SYMBOL).decode()}",
            )
        if verdict == UNKNOWN_DISPATCH:
            return verdict, (
                f"{lib.name} has EXL3 GEMM code but neither {BLIND_SYMBOL.decode()} (0.20/0.21) "
                f"nor {KEYED_SYMBOL.decode()} (0.24)"
            )
    names = ", ".join(lib.name for lib in libraries) or "none found"
    return None, f"no EXL3 GEMM in the compiled extensions ({names})"


# -- choosing a forced launch --------------------------------------------------------------------


def compute_class(major: int, minor: int) -> str:
    """exllamav3's device classes (exl3_devctx.cu): old/ampere, ada (8.9), hopper (9.x),
    blackwell (10+)."""
    if major >= 10:
        return "blackwell"
    if major == 9:
        return "hopper"
    if (major, minor) == (8, 9):
        return "ada"
    return "ampere"


def heuristic_shape(cc: str, k: int, n: int, K: int) -> int:
    """``select_gemm_shape`` of exllamav3's exl3_kernel_map.cu (single matrix), by device class."""
    mod_256, mod_512 = n % 256 == 0, n % 512 == 0
    if cc == "ampere":
        if mod_256 and K <= 4:
            return 2 if (n <= 2048 or k <= 2048) else 3
        if mod_256 and n < 4096:
            return 3 if k > 8192 else 2
        if mod_512 and n * k > 4096 * 4096 and K <= 6:
            return 4
        return 3 if mod_256 else 2
    if cc == "ada":
        if mod_256 and K <= 3:
            if k <= 2048:
                return 2
            return 2 if (n < 4096 and k <= 12288) else 3
        if n <= 16384:
            return 2
        if mod_512 and n >= 32768:
            return 4
        return 3 if mod_256 else 2
    if K in (2, 4) and k <= 2048:
        return 1
    if K >= 7:
        if mod_256 and n <= 8192:
            return 3 if k > 32768 else 2
        return 4 if (mod_512 and n > 32768) else 2
    if mod_256 and n <= 4096:
        return 3 if (k > 8192 and K >= 3) else 2
    if mod_512 and n > 16384:
        return 4
    return 3 if mod_256 else 2


def shape_fits(shape_idx: int, k: int, n: int) -> bool:
    return k % TILE_K[shape_idx] == 0 and n % TILE_N[shape_idx] == 0


def forced_launch(cc: str, k: int, n: int, K: int, device_sms: int) -> tuple[int, int] | None:
    """(force_shape_idx, force_num_sms) for exl3_gemm's uncached path, or None when no kernel
    shape tiles this layer (then only the reconstruct path is left).

    Any tiling shape is a correct kernel for every codebook (0.24.1's autotuner launches each
    one in turn); the choice only affects speed: exllamav3's shape heuristic, one block per
    tile up to one per SM (bench/exl3_codebook_cache.py measures it against the cached path)."""
    preferred = heuristic_shape(cc, k, n, K)
    for shape_idx in (preferred, 2, 3, 1, 4):
        if shape_fits(shape_idx, k, n):
            slices = (k // TILE_K[shape_idx]) * (n // TILE_N[shape_idx])
            return shape_idx, max(1, min(slices, device_sms))
    return None


# -- the load-time plan ----------------------------------------------------------------------------

GemmKey = tuple[int, int, int]  # (in_features, out_features, K) as exl3_gemm's cache sees them


def gemm_key(trellis_shape: tuple[int, ...]) -> GemmKey:
    """The cache key of a trellis ``(in/16, out/16, 16*K)`` (compute class and fp16 output are
    the same for every layer of one process)."""
    return trellis_shape[0] * 16, trellis_shape[1] * 16, trellis_shape[2] // 16


# Relative error of fp16 EXL3 GEMMs against the reconstruct path: about 5e-4 (measured on an H200 with
# aphrodite-engine 0.21.0, docs/upstream/exl3-gemm-codebook-cache.md); a wrong codebook gives about 1.4 (3INST) to
# 1.6 (mul1). Below this, two results are the same answer
SAME = 2e-2
