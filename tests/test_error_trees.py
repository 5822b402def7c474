"""Each package has one error tree, and its public functions raise from it.

For ``metropolis``, ``bmdb``, ``shepherd`` and ``console`` (and the shared ``common``,
which defines no errors of its own): every exception class a module of the
package defines derives from the package's root, and every ``raise`` of a
named class in a public function or method is of such a class or of one of
the built-in exceptions that mean misuse (see `ALLOWED_MISUSE`). Raising a
variable (a re-raise, or an error built by a helper) is not judged here:
the helpers that build errors are themselves checked.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from types import ModuleType

import pytest
import trio

from bmdb.errors import BMDBError
from console.errors import ConsoleError
from metropolis.errors import MetropolisError
from shepherd.errors import ShepherdError

ROOTS: dict[str, type[Exception] | None] = {
    "metropolis": MetropolisError,
    "bmdb": BMDBError,
    "shepherd": ShepherdError,
    "console": ConsoleError,
    "common": None,  # shared helpers: no errors of their own
}

#: Modules (and the packages below them) outside their package's tree, and why.
EXEMPT = {
    # Runs alone on the target machine with nothing but python3: it may not
    # import the shepherd package, so it cannot derive from ShepherdError.
    "shepherd.agent": "self-contained agent, standard library only",
}

#: Exceptions outside the trees a public function may raise (Python's own
#: for misuse, mostly), and what they mean.
ALLOWED_MISUSE = {
    ValueError: "an argument the function cannot accept (caller's bug)",
    TypeError: "an argument of the wrong type (caller's bug)",
    RuntimeError: "a call in the wrong state, e.g. on a closed object (caller's bug)",
    NotImplementedError: "an abstract method",
    AssertionError: "an unreachable line",
    StopAsyncIteration: "the async iterator protocol",
    StopIteration: "the iterator protocol",
    ProcessLookupError: "no such process to signal, as os.kill says (test helpers)",
    AttributeError: "no such attribute: the protocol of a module's __getattr__ (common.lazy)",
    # Not a builtin, but Trio's own convention for the same kind of misuse:
    # two tasks using something that serves one at a time (as trio streams do).
    trio.BusyResourceError: "two tasks in a one-task call (Trio's convention)",
    # argparse's convention for a ``type=`` callable refusing a value: the
    # parser prints its message after the option's name (common.argtypes).
    argparse.ArgumentTypeError: "a command-line value refused (argparse's convention)",
}


def _modules(package: str) -> Iterator[ModuleType]:
    root = importlib.import_module(package)
    yield root
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        exempt = any(info.name == m or info.name.startswith(f"{m}.") for m in EXEMPT)
        if ".proto.gen" in info.name or exempt:
            continue
        yield importlib.import_module(info.name)


def _all_modules() -> list[tuple[str, ModuleType]]:
    return [(package, module) for package in ROOTS for module in _modules(package)]


MODULES = _all_modules()


def test_the_walk_sees_every_package() -> None:
    names = {module.__name__ for _, module in MODULES}
    assert {"bmdb.transaction", "metropolis.consensus.client", "shepherd.ssh"} <= names


@pytest.mark.parametrize(("package", "module"), MODULES, ids=lambda m: getattr(m, "__name__", m))
def test_every_exception_class_derives_from_the_root(package: str, module: ModuleType) -> None:
    root = ROOTS[package]
    defined = [
        cls
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__ and issubclass(cls, BaseException)
    ]
    if root is None:
        assert not defined, f"{module.__name__} defines errors but its package has no root"
        return
    strays = [cls.__qualname__ for cls in defined if not issubclass(cls, root)]
    assert not strays, f"{module.__name__}: not derived from {root.__name__}: {strays}"


def _public_functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    def public(name: str) -> bool:
        return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and public(node.name):
            yield node
        elif isinstance(node, ast.ClassDef) and public(node.name):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and public(item.name):
                    yield item


def _raised_name(node: ast.Raise) -> ast.expr | None:
    exc = node.exc
    if isinstance(exc, ast.Call):
        exc = exc.func
    return exc if isinstance(exc, ast.Name | ast.Attribute) else None


def _resolve(module: ModuleType, expr: ast.expr) -> object:
    """The object ``expr`` names in ``module``'s namespace, or None."""
    if isinstance(expr, ast.Name):
        if expr.id in vars(module):
            return vars(module)[expr.id]
        return getattr(builtins, expr.id, None)
    assert isinstance(expr, ast.Attribute)
    base = _resolve(module, expr.value)
    return getattr(base, expr.attr, None) if base is not None else None


@pytest.mark.parametrize(("package", "module"), MODULES, ids=lambda m: getattr(m, "__name__", m))
def test_public_functions_raise_only_the_tree_or_misuse(package: str, module: ModuleType) -> None:
    root = ROOTS[package]
    source = inspect.getsource(module)
    bad = []
    for function in _public_functions(ast.parse(source)):
        for node in ast.walk(function):
            if not isinstance(node, ast.Raise):
                continue
            named = _raised_name(node)
            if named is None:
                continue
            raised = _resolve(module, named)
            if not (isinstance(raised, type) and issubclass(raised, BaseException)):
                continue  # a variable or a factory: judged where it is built
            if raised in ALLOWED_MISUSE or (root is not None and issubclass(raised, root)):
                continue
            bad.append(f"{function.name} (line {node.lineno}): {raised.__qualname__}")
    assert not bad, f"{module.__name__} raises outside its tree: {bad}"


def test_the_check_can_fail() -> None:
    """The AST walk does find a foreign exception (guards the test itself)."""
    module = ModuleType("fake")
    exec("import socket\ndef f():\n    raise socket.timeout('x')\n", vars(module))
    tree = ast.parse("import socket\ndef f():\n    raise socket.timeout('x')\n")
    [function] = _public_functions(tree)
    [node] = [n for n in ast.walk(function) if isinstance(n, ast.Raise)]
    named = _raised_name(node)
    assert named is not None
    raised = _resolve(module, named)
    assert isinstance(raised, type) and raised not in ALLOWED_MISUSE
    assert not issubclass(raised, MetropolisError)
