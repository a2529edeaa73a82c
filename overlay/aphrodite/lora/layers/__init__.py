"""Patches to files of ``aphrodite/lora/layers/`` (``utils.py``: P2, ``base_linear.py``: P2b, ``fused_moe.py``: P5)."""
