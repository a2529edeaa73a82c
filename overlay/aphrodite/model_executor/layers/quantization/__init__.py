"""Patches to ``aphrodite/model_executor/layers/quantization/exl3.py`` (the ``exl3`` package: one module a patch)."""
