"""EXL3 checkpoints as exllamav3 writes them: the format's reference codec (codec.py) and make-tiny's writers, the
tiny checkpoint with its dense twin and adapters (tiny.py, with tinyspec.py the spec and config, tinystate.py the
tensors, tinyfiles.py the other files) and the full-depth one written layer by layer (stream.py).

The format facts that need no torch live here, so torch-free tools (doctor) can use them."""

HAD = 128  # EXL3's Hadamard block: every EXL3 dimension, and every tensor-parallel slice of one, is a multiple


def splits_into_blocks(size: int, tp: int) -> bool:
    """Whether ``size`` splits into ``tp`` tensor-parallel slices of whole 128-wide Hadamard blocks."""
    return size % (HAD * tp) == 0
