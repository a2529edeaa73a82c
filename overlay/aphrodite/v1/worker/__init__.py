"""Patches to files of ``aphrodite/v1/worker/`` (``gpu_model_runner.py``: P15)."""
