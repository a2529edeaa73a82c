"""What the EXL3 patches share: the module they patch and the parsed source of a live function."""

from __future__ import annotations

import ast
import inspect
import textwrap

from hybrid_exl3_fixes.registry import Drift

MODULE = "aphrodite.model_executor.layers.quantization.exl3"


def source_tree(function, what: str) -> ast.Module:
    """``function``'s source, parsed; ``Drift`` naming ``what`` where it has none readable (a C function, a lambda
    built at run time)."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise Drift(f"{what} has no readable source: {exc}") from exc
