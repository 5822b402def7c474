"""The layering tests' one reader of imports: source files parsed, never imported.

`tests/test_package_layers.py` checks the top-level packages against each
other; `tests/metropolis/test_layers.py` and `tests/bmdb/test_layers.py`
check the modules inside one package against a table of layers. All three
find imports with `imported`: every import counts, at module level, under
TYPE_CHECKING, inside functions, relative ones (resolved), and
``importlib.import_module("...")`` of a literal name.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the module at ``path``, a file below ``root``."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(package: Path, *, skip: str | None = None) -> dict[str, Path]:
    """Every module of the package in folder ``package``, by dotted name;
    files below a folder named ``skip`` (generated code) are left out."""
    return {
        module_name(path, package.parent): path
        for path in sorted(package.rglob("*.py"))
        if skip is None or skip not in path.relative_to(package).parts
    }


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` in ``module``."""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def imported(
    module: str, path: Path, source: str, modules: Collection[str] = ()
) -> Iterator[tuple[int, str]]:
    """(line, name) of every import in ``source``, the text of ``module`` at ``path``.

    ``from X import a`` names ``X.a`` if that is one of ``modules`` (a
    submodule), else ``X``; each name once per statement.
    """
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(source, str(path))):
        if not isinstance(node, ast.stmt | ast.expr):
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _absolute(module, is_package, node.level, node.module)
            elif node.module:
                base = node.module
            else:
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                name = candidate if candidate in modules else base
                if name not in names:
                    names.append(name)
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for name in names:
            yield node.lineno, name


def unit(module: str, layers: Mapping[str, int]) -> str:
    """The entry of ``layers`` that ``module`` belongs to (itself or a package above)."""
    while module not in layers:
        if "." not in module:
            raise KeyError(f"{module} is in no layer")
        module = module.rsplit(".", 1)[0]
    return module


def upward(
    modules: Mapping[str, Path],
    layers: Mapping[str, int],
    together: Collection[frozenset[str]] = (),
) -> list[str]:
    """Each import in ``modules`` of a unit of the package in the same or a
    higher layer, as "a imports b"; two units in ``together`` may import
    each other."""
    top = next(iter(layers)).split(".")[0]
    found = []
    for name, path in sorted(modules.items()):
        own = unit(name, layers)
        names = {n for _, n in imported(name, path, path.read_text(), modules)}
        for name_imported in sorted(n for n in names if n.split(".")[0] == top):
            target = unit(name_imported, layers)
            if target == own or frozenset({own, target}) in together:
                continue
            if layers[target] >= layers[own]:
                found.append(f"{name} imports {name_imported}")
    return found
