"""Tool calls written as text (``name(arg=value)``): the literal arguments, shared by the
tool-use adapters (tau2, BFCL). Nothing is evaluated: only literals are accepted."""

from __future__ import annotations

import ast
from typing import Any

__all__ = ["literal_arg"]

_JSON_WORDS = {"true": True, "false": False, "null": None}


def literal_arg(node: ast.AST) -> Any:
    """A literal argument value; accepts JSON's true/false/null too (ValueError otherwise)."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        if isinstance(node, ast.Name) and node.id in _JSON_WORDS:
            return _JSON_WORDS[node.id]
        if isinstance(node, (ast.List, ast.Tuple)):
            return [literal_arg(e) for e in node.elts]
        if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):  # a None key: a **spread
            return {
                literal_arg(k): literal_arg(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None
            }
        raise
