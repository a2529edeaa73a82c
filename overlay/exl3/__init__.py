"""The EXL3 format: a reference codec (codec.py) and a tiny-checkpoint writer (tiny.py, with
tinyspec.py, tinystate.py and tinyfiles.py).

Facts that need no torch live here, so torch-free tools (doctor) can use them."""

HAD = 128  # EXL3's Hadamard block: every EXL3 dimension, and every tensor-parallel slice of one, is a multiple


def splits_into_blocks(size: int, tp: int) -> bool:
    """Whether ``size`` splits into ``tp`` tensor-parallel slices of whole 128-wide Hadamard blocks."""
    return size % (HAD * tp) == 0
