"""The reference EXL3 codec against independent scalar arithmetic (CPU)."""

from __future__ import annotations

import struct

import pytest
import torch

from hybrid_exl3_fixes.checkpoint import codec


def f16(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]


def scalar_value(state: int, codebook: str) -> float:
    """One state decoded with Python integers and struct, independently of the tensor code."""
    import numpy as np

    if codebook == "mul1":
        x = (state * 0x83DCD12D) & 0xFFFFFFFF
        h = f16(0x6400 + sum((x >> s) & 0xFF for s in (0, 8, 16, 24)))
        return float(np.float16(h * f16(0x1EEE) + f16(0xC931)))  # fused: one rounding
    x = (state * 89226354 + 64248484) if codebook == "3inst" else state * 0xCBAC1FED
    x = ((x & 0xFFFFFFFF) & 0x8FFF8FFF) ^ 0x3B603B60
    return float(np.float16(np.float16(f16(x)) + np.float16(f16(x >> 16))))


@pytest.mark.parametrize("codebook", codec.CODEBOOKS)
def test_codebook_known_answers(codebook):
    lut = codec.codebook_lut(codebook)
    for state in (0, 1, 2, 0x1234, 0x7FFF, 0x8000, 0xBEEF, 0xFFFF) + tuple(range(3, 65536, 4099)):
        assert float(lut[state]) == scalar_value(state, codebook), (codebook, hex(state))
    assert torch.isfinite(lut.float()).all()
    assert 0.5 < float(lut.float().std()) < 2.0  # roughly unit Gaussian codebooks


def test_codebooks_differ():
    luts = [codec.codebook_lut(c) for c in codec.CODEBOOKS]
    assert not torch.equal(luts[0], luts[1]) and not torch.equal(luts[1], luts[2])


@pytest.mark.parametrize("K", range(1, 9))
def test_states_follow_the_tail_biting_recurrence(K):
    gen = torch.Generator().manual_seed(K)
    symbols = torch.randint(0, 1 << K, (3, 256), generator=gen)
    trellis = codec.symbols_to_trellis(symbols, K)
    assert trellis.dtype == torch.int16 and trellis.shape == (3, 16 * K)
    got = codec.states(trellis, K)
    for row in range(3):
        seq = symbols[row].tolist()
        state = 0
        for sym in seq:  # warm-up over one full cycle gives the tail-biting start state
            state = ((state << K) | sym) & 0xFFFF
        for t, sym in enumerate(seq):
            state = ((state << K) | sym) & 0xFFFF
            assert int(got[row, t]) == state, (K, row, t)
    assert torch.equal(codec.trellis_to_symbols(trellis, K), symbols)


def test_bitstream_is_little_endian_uint32_words_msb_first():
    K = 4
    trellis = torch.zeros(16 * K, dtype=torch.int16)
    trellis[1] = 0x1000  # high half of uint32 word 0: its top 4 bits are the first symbol, 0b0001
    s = codec.states(trellis, K)
    assert int(s[0]) == 0x0001
    assert int(s[3]) == 0x1000
    assert int(s[4]) == 0x0000
    trellis = torch.zeros(16 * K, dtype=torch.int16)
    trellis[0] = 0x1000  # low half of word 0: symbols 4..7, the first is 0b0001
    s = codec.states(trellis, K)
    assert int(s[3]) == 0x0000 and int(s[4]) == 0x0001 and int(s[7]) == 0x1000


@pytest.mark.parametrize("K", [0, 9])
def test_bad_bitrate_is_rejected(K):
    with pytest.raises(ValueError, match="1..8"):
        codec.states(torch.zeros(16, dtype=torch.int16), K)


def test_tensor_core_perm_is_a_permutation():
    perm = codec.tensor_core_perm()
    assert sorted(perm.tolist()) == list(range(256))
    assert perm[:8].tolist() == [0, 16, 128, 144, 8, 24, 136, 152]


def test_hadamard_is_orthonormal_and_blockwise():
    x = torch.randn(3, 256, dtype=torch.float64)
    y = codec.hadamard_blocks(x, 1)
    h = codec.sylvester() / 128**0.5
    assert torch.allclose(h @ h, torch.eye(128, dtype=torch.float64))
    assert torch.allclose(y, x @ torch.block_diag(h, h))
    assert torch.allclose(codec.hadamard_blocks(y, 1), x)
    with pytest.raises(ValueError, match="multiple of 128"):
        codec.hadamard_blocks(torch.zeros(2, 100), 1)


@pytest.mark.parametrize("codebook", codec.CODEBOOKS)
def test_dense_weight_matches_the_explicit_formula(codebook):
    gen = torch.Generator().manual_seed(7)
    tensors = codec.random_exl3_linear(256, 128, 3, codebook, gen)
    assert tensors["trellis"].shape == (16, 8, 48)
    assert codec.codebook_of(tensors) == codebook
    w = codec.dense_weight(tensors)
    # explicit: diag(suh) H W_rot H diag(svh) with dense matrices
    w_rot = codec.decode_tiles(tensors["trellis"], 3, codebook).double()
    h = codec.sylvester().double() / 128**0.5
    h_in, h_out = torch.block_diag(h, h), h
    expected = torch.diag(tensors["suh"].double()) @ h_in @ w_rot @ h_out @ torch.diag(tensors["svh"].double())
    assert torch.allclose(w.double(), expected, atol=1e-6)
    assert 0.01 < float(w.std()) < 0.04  # about the requested scale 0.02


def test_decode_tiles_places_positions_by_the_tensor_core_perm():
    K = 8  # with K = 16/2 bits per symbol pair the state of t is (sym_{t-1} << 8) | sym_t
    symbols = torch.arange(256).view(1, 1, 256) % 256
    trellis = codec.symbols_to_trellis(symbols, K)
    tile = codec.decode_tiles(trellis, K, "3inst")
    lut = codec.codebook_lut("3inst")
    perm = codec.tensor_core_perm()
    for t in (0, 1, 9, 200, 255):
        state = ((int(symbols[0, 0, t - 1]) << 8) | int(symbols[0, 0, t])) & 0xFFFF
        row, col = divmod(int(perm[t]), 16)
        assert tile[row, col] == lut[state]


def test_misaligned_dimensions_are_rejected():
    with pytest.raises(ValueError, match="multiples of 128"):
        codec.random_exl3_linear(200, 128, 4, "mcg", torch.Generator())


def test_banded_decode_equals_whole_decode():
    tensors = codec.random_exl3_linear(512, 384, 5, "mul1", torch.Generator().manual_seed(3))
    whole = codec.decode_tiles(tensors["trellis"], 5, "mul1", max_chunk_bytes=1 << 40)
    banded = codec.decode_tiles(tensors["trellis"], 5, "mul1", max_chunk_bytes=1)  # one tile row at a time
    assert torch.equal(whole.view(torch.int16), banded.view(torch.int16))
