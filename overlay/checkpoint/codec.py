"""Reference EXL3 codec in plain PyTorch (CPU or GPU), written from the format description.

Format (exllamav3 1.6.5, ``exllamav3/modules/quant/exl3_lib/quantize.py`` and its ``exllamav3_ext/quant``
codebook kernels, as aphrodite-engine 0.21.0's ``quantization/exl3.py`` loads it; each rule checked bit for bit against
aphrodite's ``exl3_reconstruct`` on an H200, docs/gpu-runs/2026-11-30-run1 and tests/gpu/test_kernels.py):

* A quantized linear with in-features ``I``, out-features ``O`` and integer bitrate ``K`` stores
  ``trellis`` int16 ``(I/16, O/16, 16*K)``, ``suh`` fp16 ``(I,)``, ``svh`` fp16 ``(O,)`` and an
  optional int32 scalar ``mcg`` (0xCBAC1FED) or ``mul1`` (0x83DCD12D) naming the codebook;
  neither means 3INST.
* Each 16x16 tile is a tail-biting bitstream of ``256*K`` bits: the tile's ``16*K`` int16 words
  taken as ``8*K`` little-endian uint32 words (``u32[m] = w[2m] | w[2m+1] << 16``), each read
  MSB-first, so the stream visits ``w[1], w[0], w[3], w[2], ...``. (Measured on an H200: reading
  the int16 words in plain order disagrees with ``exl3_reconstruct`` everywhere; the word and
  shift arithmetic of exllamav3's Triton decoder confirms the uint32 order.) The state of
  position ``t`` is the 16-bit window ending at bit ``(t+1)*K``:
  ``s_t = ((s_{t-1} << K) | sym_t) & 0xFFFF``, wrapping around the tile's end.
* Codebooks map a state to an fp16 value: 3INST ``x = s*89226354 + 64248484``, mcg
  ``x = s*0xCBAC1FED`` (mod 2^32), then ``x = (x & 0x8FFF8FFF) ^ 0x3B603B60`` and
  value = fp16(low half) + fp16(high half); mul1 ``x = s*0x83DCD12D``,
  ``h = fp16 bits(0x6400 + sum of x's 4 bytes)``, value = ``h*half(0x1EEE) + half(0xC931)``
  as one fused multiply-add (one rounding; measured on an H200: multiply-then-add in fp16
  differs from ``exl3_reconstruct`` in about 92% of the values, the fused form in none).
* Position ``t`` of a tile lands at element ``perm[t]`` of the row-major 16x16 tile, with
  ``perm`` the tensor-core permutation of exllamav3's ``quantize.py``.
* ``W = diag(suh) . H . W_rot . H . diag(svh)`` with ``H`` block-diagonal Sylvester 128x128
  scaled by 1/sqrt(128); the layer computes ``y = x @ W`` (``W`` is ``I x O``).
"""

from __future__ import annotations

import math
from functools import cache

import torch

from . import HAD

CODEBOOKS = ("3inst", "mcg", "mul1")
MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
_MASK32 = 0xFFFFFFFF


def _u32_to_i32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


MARKERS = {"mcg": _u32_to_i32(MCG_MULT), "mul1": _u32_to_i32(MUL1_MULT)}


def marker_tensors(codebook: str) -> dict[str, torch.Tensor]:
    """The scalar tensor that names ``codebook`` in a checkpoint ({} for 3INST, which has none)."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown codebook {codebook!r}; expected one of {CODEBOOKS}")
    return {codebook: torch.tensor(MARKERS[codebook], dtype=torch.int32)} if codebook in MARKERS else {}


@cache
def tensor_core_perm() -> torch.Tensor:
    """perm[t] = row-major tile element that trellis position t decodes into."""
    perm = [0] * 256
    for lane in range(32):
        r0 = (lane % 4) * 2
        c0 = lane // 4
        rows = (r0, r0 + 1, r0 + 8, r0 + 9)
        for half, col in enumerate((c0, c0 + 8)):
            for i, row in enumerate(rows):
                perm[lane * 8 + half * 4 + i] = row * 16 + col
    return torch.tensor(perm, dtype=torch.long)


def _f16(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret the low 16 bits of an int64 tensor as fp16."""
    low = bits & 0xFFFF
    return (low - ((low & 0x8000) << 1)).to(torch.int16).view(torch.float16)


@cache
def codebook_lut(codebook: str) -> torch.Tensor:
    """fp16 value of each of the 65536 states."""
    s = torch.arange(65536, dtype=torch.int64)
    if codebook in ("3inst", "mcg"):
        x = (s * 89226354 + 64248484) & _MASK32 if codebook == "3inst" else (s * MCG_MULT) & _MASK32
        x = (x & 0x8FFF8FFF) ^ 0x3B603B60
        return _f16(x) + _f16(x >> 16)  # one fp16 rounding, as __hadd
    if codebook == "mul1":
        x = (s * MUL1_MULT) & _MASK32
        total = 0x6400 + (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
        h = _f16(total).double()
        scale = _f16(torch.tensor(0x1EEE)).double()
        bias = _f16(torch.tensor(0xC931)).double()
        return (h * scale + bias).half()  # exact in float64, then one rounding: __hfma
    raise ValueError(f"unknown codebook {codebook!r}; expected one of {CODEBOOKS}")


def codebook_of(tensors: dict[str, torch.Tensor]) -> str:
    if "mcg" in tensors and "mul1" in tensors:
        raise ValueError("a tensor may name only one codebook (both mcg and mul1 present)")
    return "mcg" if "mcg" in tensors else "mul1" if "mul1" in tensors else "3inst"


# -- bitstreams ----------------------------------------------------------------------------


def _swap_halves(words: torch.Tensor) -> torch.Tensor:
    """int16 words in storage order <-> stream order (pairs swapped: uint32 words read MSB-first)."""
    return words.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


def _stream_bits(trellis: torch.Tensor) -> torch.Tensor:
    """(..., 16*K) int16 -> (..., 256*K) bits (int64 0/1) in stream order."""
    words = _swap_halves(trellis.to(torch.int64) & 0xFFFF)
    shifts = torch.arange(15, -1, -1, dtype=torch.int64, device=trellis.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)


def states(trellis: torch.Tensor, K: int) -> torch.Tensor:
    """(..., 16*K) int16 -> (..., 256) int64 states, position order."""
    if not 1 <= K <= 8:
        raise ValueError(f"bitrate K must be 1..8, got {K}")
    if trellis.shape[-1] != 16 * K:
        raise ValueError(f"trellis last dimension {trellis.shape[-1]} != 16*K = {16 * K}")
    bits = _stream_bits(trellis)
    n = bits.shape[-1]
    # window of 16 bits ending at (t+1)*K, circular
    ends = (torch.arange(256, device=trellis.device) + 1) * K
    idx = (ends.unsqueeze(-1) - 16 + torch.arange(16, device=trellis.device)) % n
    window = bits[..., idx]  # (..., 256, 16)
    weights = 1 << torch.arange(15, -1, -1, dtype=torch.int64, device=trellis.device)
    return (window * weights).sum(-1)


def symbols_to_trellis(symbols: torch.Tensor, K: int) -> torch.Tensor:
    """Pack per-position K-bit symbols (..., 256) into trellis words (..., 16*K) int16.

    Every symbol sequence is a valid trellis; the decoded state of position t is the last 16
    bits of the circular symbol stream up to t.
    """
    if not 1 <= K <= 8:
        raise ValueError(f"bitrate K must be 1..8, got {K}")
    if symbols.shape[-1] != 256:
        raise ValueError("a tile has 256 positions")
    if symbols.min() < 0 or symbols.max() >= 1 << K:
        raise ValueError(f"symbols must be in [0, {1 << K})")
    shifts = torch.arange(K - 1, -1, -1, dtype=torch.int64, device=symbols.device)
    bits = ((symbols.to(torch.int64).unsqueeze(-1) >> shifts) & 1).flatten(-2)  # (..., 256*K)
    bits = bits.unflatten(-1, (16 * K, 16))
    weights = 1 << torch.arange(15, -1, -1, dtype=torch.int64, device=symbols.device)
    words = _swap_halves((bits * weights).sum(-1))
    return (words - ((words & 0x8000) << 1)).to(torch.int16)


def trellis_to_symbols(trellis: torch.Tensor, K: int) -> torch.Tensor:
    return states(trellis, K) & ((1 << K) - 1)


# -- tiles and matrices --------------------------------------------------------------------


def decode_tiles(trellis: torch.Tensor, K: int, codebook: str, max_chunk_bytes: int = 1 << 28) -> torch.Tensor:
    """(I/16, O/16, 16*K) -> W_rot (I, O) fp16, before the Hadamard transforms and scales.

    Decodes a band of tile rows at a time so the state windows (16 int64 per weight) stay under
    ``max_chunk_bytes``: a 5120 x 17408 layer would otherwise need about 11 GB."""
    ti, to, _ = trellis.shape
    lut = codebook_lut(codebook).to(trellis.device)
    perm = tensor_core_perm().to(trellis.device)
    out = torch.empty(ti * 16, to * 16, dtype=torch.float16, device=trellis.device)
    step = max(1, max_chunk_bytes // (to * 256 * 16 * 8))
    for a in range(0, ti, step):
        b = min(ti, a + step)
        values = lut[states(trellis[a:b], K)]  # (rows, to, 256) in position order
        tiles = torch.empty_like(values)
        tiles[..., perm] = values
        out[a * 16 : b * 16] = tiles.view(b - a, to, 16, 16).permute(0, 2, 1, 3).reshape((b - a) * 16, to * 16)
    return out


@cache
def sylvester(n: int = HAD) -> torch.Tensor:
    """Sylvester Hadamard matrix of order n (a power of two), entries +-1, float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_blocks(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Apply H (block-diagonal 128x128 Sylvester / sqrt(128)) along ``dim`` of a float tensor."""
    if x.shape[dim] % HAD:
        raise ValueError(f"dimension {x.shape[dim]} is not a multiple of {HAD}")
    h = (sylvester() / math.sqrt(HAD)).to(x.dtype).to(x.device)
    moved = x.movedim(dim, -1)
    out = (moved.unflatten(-1, (-1, HAD)) @ h).flatten(-2)
    return out.movedim(-1, dim)


def linear_tensors(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """One EXL3 linear's tensors (``trellis``, ``suh``, ``svh``, the codebook marker) out of a checkpoint's state,
    by its module name ``prefix``, keyed by their own names."""
    return {name.rsplit(".", 1)[1]: t for name, t in state.items() if name.rsplit(".", 1)[0] == prefix}


def dense_weight(
    tensors: dict[str, torch.Tensor], K: int | None = None, device: str | torch.device | None = None
) -> torch.Tensor:
    """The exact dense ``W`` (I x O, float32) of one EXL3 linear: y = x @ W, computed on ``device``
    (default: where the tensors are), returned there."""
    if device is not None:
        tensors = {k: v.to(device) for k, v in tensors.items()}
    trellis = tensors["trellis"]
    K = K if K is not None else trellis.shape[-1] // 16
    w_rot = decode_tiles(trellis, K, codebook_of(tensors)).to(torch.float64)
    w = hadamard_blocks(hadamard_blocks(w_rot, 0), 1)  # H symmetric: H W H
    w = tensors["suh"].to(torch.float64)[:, None] * w * tensors["svh"].to(torch.float64)[None, :]
    return w.to(torch.float32)


def sign_scale(codebook: str, scale: float = 0.02) -> float:
    """The magnitude of the random ``suh``/``svh`` signs that gives dense weights of standard deviation
    about ``scale`` with this codebook."""
    return math.sqrt(scale / float(codebook_lut(codebook).float().std()))


def random_exl3_linear(
    in_features: int,
    out_features: int,
    K: int,
    codebook: str,
    generator: torch.Generator,
    scale: float = 0.02,
    device: str | torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """A valid EXL3 linear from random symbols; ``suh``/``svh`` are random signs times sqrt(scale)
    so the dense weights have a standard deviation of about ``scale``. The symbols come from
    ``generator`` (on the CPU) whatever ``device`` packs them, so the result does not depend on it;
    the returned tensors are on the CPU."""
    if in_features % HAD or out_features % HAD:
        raise ValueError(f"EXL3 dimensions must be multiples of {HAD}: got {in_features}x{out_features}")
    symbols = torch.randint(0, 1 << K, (in_features // 16, out_features // 16, 256), generator=generator)
    trellis = symbols_to_trellis(symbols.to(device) if device else symbols, K).cpu()
    root = sign_scale(codebook, scale)
    signs_in = torch.randint(0, 2, (in_features,), generator=generator) * 2 - 1
    signs_out = torch.randint(0, 2, (out_features,), generator=generator) * 2 - 1
    return {
        "trellis": trellis,
        "suh": (signs_in * root).to(torch.float16),
        "svh": (signs_out * root).to(torch.float16),
        **marker_tensors(codebook),
    }
