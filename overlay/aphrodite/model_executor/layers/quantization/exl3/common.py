"""What the EXL3 patches share: the module they patch and the parsed source of a live function."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable

from hybrid_exl3_fixes.registry import Drift, logger, tag

MODULE = "aphrodite.model_executor.layers.quantization.exl3"


def source_tree(function, what: str) -> ast.Module:
    """``function``'s source, parsed; ``Drift`` naming ``what`` where it has none readable (a C function, a lambda
    built at run time)."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise Drift(f"{what} has no readable source: {exc}") from exc


def after_loading(patch_id: str, original: Callable, step: Callable, failure: str, name_attr: str) -> Callable:
    """A ``process_weights_after_loading`` that runs ``original``, then ``step(self, layer)``. A failing step is
    logged (``failure`` % the layer's ``name_attr``, with the traceback) and never fails a load that upstream would
    have finished."""

    def process_weights_after_loading(self, layer):
        original(self, layer)
        try:
            step(self, layer)
        except Exception:
            logger.warning(failure, getattr(layer, name_attr, type(layer).__name__), exc_info=True)

    return tag(patch_id, process_weights_after_loading, original)
