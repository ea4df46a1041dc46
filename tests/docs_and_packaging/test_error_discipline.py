"""Every deliberate ``raise`` in library code (lifemem_ray/ and actors/) raises a
:class:`~lifemem_ray.core.errors.LifeMemError`: the checker walks each module's syntax tree
and resolves what each ``raise`` names in the imported module's namespace (a class, a
function's declared return type, a method of the enclosing class, or a local variable
assigned from one of those); a builtin exception, a foreign class, or something it cannot
tell fails the test with ``file:line``. Re-raising what an ``except ... as name`` caught is
fine (it was checked where it was raised). The few protocol-bound exceptions are listed in
:data:`ALLOWED` with the reason."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lifemem_ray.core.errors import LifeMemError

ROOT = Path(__file__).resolve().parents[2]
TREES = {"lifemem_ray": "lifemem_ray", "actors": "lifemem_ray.actors"}  # folder -> installed package
OPTIONAL = {
    "textworld_express",
    "alfworld",
    "scienceworld",
    "selenium",
    "tau2",
    "bfcl_eval",
    "llama_cpp",
    "skyrl_gym",
    "verl",
}

# (file, what is raised as the source spells it) -> why it need not be a LifeMemError.
ALLOWED: dict[tuple[str, str], str] = {
    ("lifemem_ray/episodes/episode_options.py", "ValueError"): (
        "pydantic's protocol for a field validator's refusal; validated() turns it into a LifeMemError naming the field"
    ),
    ("lifemem_ray/lab/envs/jvm.py", "NotImplementedError"): "the JVM base's methods each simulator adapter must give",
    ("lifemem_ray/cli/__main__.py", "SystemExit"): "the entry point hands main()'s exit code to the interpreter",
    ("lifemem_ray/__init__.py", "AttributeError"): "a module __getattr__ (PEP 562) answers an unknown name so",
    ("actors/__init__.py", "AttributeError"): "a module __getattr__ (PEP 562) answers an unknown name so",
    ("lifemem_ray/cli/setting_flags.py", "argparse.ArgumentTypeError"): (
        "argparse's protocol for a refused value: it prints the message with the command's usage"
    ),
    ("lifemem_ray/core/importers.py", "raw"): (
        "a RecordError read ahead by _raw_records (narrowed by isinstance just above), raised at its line's turn"
    ),
    ("actors/cluster/batching.py", "stage.error"): (
        "an error a pipelined stage caught (checked where raised), raised again where the batch is awaited"
    ),
    ("lifemem_ray/engine/embedding/batcher.py", "request.error"): (
        "the shared model call's error (the backend's), raised again in each caller of that batch"
    ),
    ("actors/cluster/coordinator.py", "failed"): "a shard's error gathered with return_exceptions, raised again",
    ("actors/cluster/remote_errors.py", "cause"): "a remote task's own error, raised without Ray's wrapper",
    ("actors/cluster/remote_errors.py", "exc.as_instanceof_cause"): "Ray's wrapper as an instance of the remote cause",
    ("actors/cluster/remote_errors.py", "exc"): "a Ray error with no usable cause, raised as it came",
    ("actors/frontdoor/front_service.py", "remote_cause"): "a remote task's own error, unwrapped from Ray's",
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [TREES[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_only_namespace(tree: ast.Module, package: str) -> dict[str, Any]:
    """What a module's top-level imports bind, for a module that cannot be imported as a
    whole (an absent optional dependency, a ``__main__``): each import tried on its own."""
    namespace: dict[str, Any] = {"__name__": package + "._static", "__package__": package}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            try:
                exec(compile(ast.Module([node], []), "<imports>", "exec"), namespace)
            except ImportError:
                pass
    return namespace


def module_namespace(path: Path, tree: ast.Module) -> dict[str, Any]:
    name = module_name(path)
    if path.name == "__main__.py":  # importing it runs the command line
        return imports_only_namespace(tree, name.rpartition(".")[0])
    try:
        return vars(importlib.import_module(name))
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in OPTIONAL:
            raise
        return imports_only_namespace(tree, name.rpartition(".")[0])


def _lookup(expr: ast.expr, namespace: dict[str, Any], owner: str | None) -> Any:
    """The object ``expr`` (a dotted name; ``self.x`` inside a class) names, or None."""
    if isinstance(expr, ast.Name):
        if expr.id in namespace:
            return namespace[expr.id]
        return getattr(builtins, expr.id, None)
    if isinstance(expr, ast.Attribute):
        if isinstance(expr.value, ast.Name) and expr.value.id in ("self", "cls") and owner:
            base = namespace.get(owner)
        else:
            base = _lookup(expr.value, namespace, owner)
        return getattr(base, expr.attr, None) if base is not None else None
    return None


def _returned_class(fn: Any, namespace: dict[str, Any]) -> Any:
    """The class a function says it returns, or None."""
    try:
        hint = typing.get_type_hints(fn).get("return")
    except Exception:
        hint = getattr(fn, "__annotations__", {}).get("return")
        if isinstance(hint, str):
            hint = namespace.get(hint)
    return hint if inspect.isclass(hint) else None


def verdict(obj: Any, called: bool, namespace: dict[str, Any]) -> str | None:
    """None when ``obj`` (called or not) gives a LifeMemError, else why not."""
    if inspect.isclass(obj):
        return None if issubclass(obj, LifeMemError) else f"{obj.__module__}.{obj.__qualname__} is not a LifeMemError"
    if called and callable(obj):
        cls = _returned_class(obj, namespace)
        if cls is None:
            return f"{getattr(obj, '__qualname__', obj)} declares no exception class it returns"
        return None if issubclass(cls, LifeMemError) else f"returns {cls.__qualname__}, not a LifeMemError"
    return "cannot tell what is raised"


class RaiseChecker(ast.NodeVisitor):
    """Collects ``(line, what is raised, why it is not a LifeMemError)`` for one module."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self.namespace = namespace
        self.classes: list[str] = []
        self.functions: list[ast.AST] = []
        self.caught: list[str] = []  # names bound by the enclosing except clauses
        self.local_imports: list[dict[str, Any]] = []  # what each enclosing function imports lazily
        self.found: list[tuple[int, str, str]] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node)
        self.local_imports.append(self._imports_in(node))
        self.generic_visit(node)
        self.local_imports.pop()
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        self.caught.append(node.name or "")
        self.generic_visit(node)
        self.caught.pop()

    def visit_Raise(self, node: ast.Raise) -> None:
        if node.exc is not None:
            called = isinstance(node.exc, ast.Call)
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            why = self.why_not(target, called)
            if why is not None:
                self.found.append((node.lineno, ast.unparse(target), why))
        self.generic_visit(node)

    def _imports_in(self, function: ast.AST) -> dict[str, Any]:
        """The names a function's own ``import`` statements bind (a lazy import)."""
        scope = {k: self.namespace.get(k) for k in ("__name__", "__package__")}
        for node in ast.walk(function):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                try:
                    exec(compile(ast.Module([node], []), "<imports>", "exec"), scope)
                except ImportError:
                    pass
        return scope

    def why_not(self, target: ast.expr, called: bool) -> str | None:
        owner = self.classes[-1] if self.classes else None
        scope = dict(self.namespace)
        for imported in self.local_imports:
            scope.update((k, v) for k, v in imported.items() if not k.startswith("__"))
        obj = _lookup(target, scope, owner)
        if obj is not None:
            return verdict(obj, called, scope)
        if isinstance(target, ast.Name) and not called:
            if target.id in self.caught:
                return None  # raising again what was caught
            made = list(self._assigned_calls(target.id))
            if made:
                whys = [verdict(_lookup(f, scope, owner), True, scope) for f in made]
                return next((w for w in whys if w), None)
        return "cannot tell what is raised"

    def _assigned_calls(self, name: str) -> Iterator[ast.expr]:
        """The callables whose result the enclosing function assigns to ``name``."""
        if not self.functions:
            return
        for node in ast.walk(self.functions[-1]):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                yield node.value.func if isinstance(node.value, ast.Call) else node.value


def bad_raises(source: str, namespace: dict[str, Any]) -> list[tuple[int, str, str]]:
    """``(line, what is raised, why)`` for each raise of ``source`` that is not a LifeMemError."""
    checker = RaiseChecker(namespace)
    checker.visit(ast.parse(source))
    return checker.found


def library_files() -> list[Path]:
    return sorted(p for tree in TREES for p in (ROOT / tree).rglob("*.py") if "__pycache__" not in p.parts)


def _namespace_of(source: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(source, "<snippet>", "exec"), namespace)
    return namespace


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ('def f():\n    raise ValueError("x")\n', [(2, "ValueError")]),
        ("def f():\n    raise KeyError\n", [(2, "KeyError")]),
        ("import os\ndef f():\n    raise os.error('x')\n", [(3, "os.error")]),
        ('def f():\n    err = TypeError("x")\n    raise err\n', [(3, "err")]),
        ("def f(e):\n    raise e\n", [(2, "e")]),
        ('from lifemem_ray.core.errors import ConfigError\ndef f():\n    raise ConfigError("x")\n', []),
        ("from lifemem_ray.core import errors\ndef f():\n    raise errors.StoreError('x')\n", []),
        ("def f():\n    try:\n        g()\n    except ValueError as exc:\n        raise exc\n", []),
        ("def f():\n    try:\n        g()\n    except ValueError:\n        raise\n", []),
        ("def f():\n    from lifemem_ray.core.errors import StoreError\n    raise StoreError('x')\n", []),
        (
            "from lifemem_ray.core.errors import TaskError\n"
            "class C:\n    def make(self) -> TaskError:\n        return TaskError('x')\n"
            "    def f(self):\n        raise self.make()\n",
            [],
        ),
        (
            "class C:\n    def make(self) -> KeyError:\n        return KeyError()\n    def f(self):\n        raise self.make()\n",
            [(5, "self.make")],
        ),
        (
            "from lifemem_ray.core.errors import TaskError\n"
            "def make() -> TaskError:\n    return TaskError('x')\n"
            "def f():\n    raise make()\n",
            [],
        ),
    ],
)
def test_the_checker_flags_what_is_not_a_lifemem_error(source, flagged):
    found = bad_raises(source, _namespace_of(source))
    assert [(line, what) for line, what, _ in found] == flagged
