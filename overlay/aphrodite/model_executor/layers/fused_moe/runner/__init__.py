"""Patches to files of ``aphrodite/model_executor/layers/fused_moe/runner/`` (``shared_experts.py``: P6)."""
