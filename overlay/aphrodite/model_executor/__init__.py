"""Patches to files of ``aphrodite/model_executor/`` (under ``layers/``)."""
