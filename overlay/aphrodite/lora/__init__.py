"""Patches to files of ``aphrodite/lora/`` (``utils.py``: P11)."""
