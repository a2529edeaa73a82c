"""The EXL3 format: a reference codec (codec.py) and a tiny-checkpoint writer (tiny.py)."""
