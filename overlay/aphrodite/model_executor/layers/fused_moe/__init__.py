"""Patches to files of ``aphrodite/model_executor/layers/fused_moe/`` (under ``runner/``)."""
