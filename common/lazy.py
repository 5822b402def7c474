"""A package's public names, imported when first used (PEP 562).

Python runs a package's ``__init__`` before any module of the package: a
``bmdb/__init__.py`` that imports ``bmdb.connection`` to offer
``bmdb.open_connection`` makes ``python -m bmdb --help`` (which imports
``bmdb.__main__``, hence ``bmdb``) pay for psycopg and Trio. With
:func:`exports`, the package keeps its names (``bmdb.open_connection``,
``from bmdb import Isolation``) and imports each one's module on first use::

    from typing import TYPE_CHECKING

    from common.lazy import exports

    if TYPE_CHECKING:  # what type checkers see
        from bmdb.connection import Connection as Connection
    else:
        __getattr__ = exports(__name__, {"bmdb.connection": ["Connection"]})

Type checkers see the imports, and no module ``__getattr__`` (with one,
mypy would let any misspelt name through as ``object``). The two blocks
name the same things (``tests/common/test_lazy.py`` checks every package
that uses this).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping

__all__ = ["exports"]


def exports(package: str, names: Mapping[str, Iterable[str]]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: each name of ``names[module]``
    is ``module``'s attribute of that name, imported on first use.

    Once imported, a name is kept in the package's namespace, so later uses
    are plain attribute reads. Any other name raises `AttributeError`, as a
    missing attribute does. An import error of the module propagates.
    """
    where = {name: module for module, listed in names.items() for name in listed}

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        # The import statement's way, not importlib.import_module: only it
        # is timed by ``python -X importtime``, which tests/test_cli_imports.py
        # reads to hold each command to its modules.
        __import__(module)
        value = getattr(sys.modules[module], name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
