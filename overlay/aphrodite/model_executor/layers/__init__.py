"""Patches to files of ``aphrodite/model_executor/layers/`` (``quantization/exl3.py``, ``fused_moe/runner/``)."""
