"""Our top-level packages import one way (see ARCHITECTURE.md):

    bench, tools, noxfile   anything but tests
    tests                   anything
    console                 bmdb, metropolis, common
    shepherd                bmdb, metropolis (its proto and owner APIs), common
    bmdb      metropolis    common
    common                  none of ours

Every import counts: at module level, under TYPE_CHECKING, inside functions,
relative ones (resolved), and ``importlib.import_module("...")`` of a literal
name. The files are parsed, not imported, so a violation is found even in
code no test runs. (That the agent, `shepherd/agent/`, imports nothing but
the standard library is checked by tests/shepherd/test_agent.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.layering import imported, module_name

ROOT = Path(__file__).resolve().parents[1]

_PRODUCT = {"common", "metropolis", "bmdb", "shepherd", "console"}

#: Each top-level package (or module) and the others of ours it may import.
ALLOWED: dict[str, frozenset[str]] = {
    "common": frozenset(),
    "metropolis": frozenset({"common"}),
    "bmdb": frozenset({"common"}),
    # The fleet installs cluster nodes: it may speak their protocol.
    "shepherd": frozenset({"bmdb", "metropolis", "common"}),
    # The operator console shows the fleet and the cluster; nothing imports it.
    "console": frozenset({"bmdb", "metropolis", "common"}),
    # Benchmarks and tools use the product, never the tests' helpers: what
    # they start lives in the package it serves (ARCHITECTURE.md).
    "bench": frozenset(_PRODUCT),
    "tools": frozenset(_PRODUCT | {"bench"}),
    "noxfile": frozenset(_PRODUCT | {"bench", "tools"}),
    "tests": frozenset(_PRODUCT | {"bench", "tools", "tests"}),
}


@dataclass(frozen=True)
class Import:
    """One import of one of our packages, as the failure message shows it."""

    path: Path
    line: int
    module: str  # the importing module, e.g. "bmdb.__main__"
    imported: str  # the module named, e.g. "metropolis.errors"

    def __str__(self) -> str:
        top = self.module.split(".")[0]
        may = ", ".join(sorted(ALLOWED[top] - {top})) or "none of ours"
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return (
            f"{where}:{self.line}: {self.module} imports {self.imported}"
            f" ({top} may import only: {may})"
        )


def _packages() -> set[str]:
    """Our top-level packages and modules, as found in the tree."""
    found = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    found |= {p.stem for p in ROOT.glob("*.py")}
    return {name for name in found if not name.startswith(".")}


def _files() -> Iterator[tuple[str, Path]]:
    """Every Python file of ours, with its module name."""
    for path in sorted(ROOT.glob("*.py")):
        yield path.stem, path
    for init in sorted(ROOT.glob("*/__init__.py")):
        for path in sorted(init.parent.rglob("*.py")):
            yield module_name(path, ROOT), path


def imports(module: str, path: Path, source: str) -> Iterator[Import]:
    """The imports of our packages in ``source`` (the text of ``module`` at ``path``)."""
    ours = set(ALLOWED)
    for line, name in imported(module, path, source):
        if name.split(".")[0] in ours:
            yield Import(path, line, module, name)


def violations(module: str, path: Path, source: str) -> list[Import]:
    top = module.split(".")[0]
    return [
        i
        for i in imports(module, path, source)
        if i.imported.split(".")[0] != top and i.imported.split(".")[0] not in ALLOWED[top]
    ]


def test_every_package_has_a_rule() -> None:
    """A new top-level package must be placed in the layers before it can pass."""
    assert _packages() - set(ALLOWED) == set()


def test_imports_go_only_the_allowed_way() -> None:
    found = [
        str(v)
        for module, path in _files()
        for v in violations(module, path, path.read_text(encoding="utf-8"))
    ]
    assert not found, "imports against the package layers:\n" + "\n".join(found)


def test_the_walk_sees_every_package() -> None:
    seen = {module.split(".")[0] for module, _ in _files()}
    assert seen == _packages()
    assert {"bmdb.__main__", "console.cluster", "shepherd.agent.wire"} <= {m for m, _ in _files()}


def test_the_check_can_fail() -> None:
    """Guards the check itself: an upward import inside a function, a relative
    import that leaves its package, and a literal ``import_module`` are found,
    and the message names the module and the import."""
    source = (
        "import importlib\n"
        "def f():\n"
        "    from console.cluster import ClusterView\n"
        "    importlib.import_module('shepherd.cli')\n"
        "from ..metropolis import owner\n"
    )
    path = ROOT / "bmdb" / "fake.py"
    found = sorted(str(v) for v in violations("bmdb.fake", path, source))
    assert found == [
        "bmdb/fake.py:3: bmdb.fake imports console.cluster (bmdb may import only: common)",
        "bmdb/fake.py:4: bmdb.fake imports shepherd.cli (bmdb may import only: common)",
        "bmdb/fake.py:5: bmdb.fake imports metropolis (bmdb may import only: common)",
    ]
    # Within the package, relative imports are fine; tests may import anything.
    assert violations("bmdb.fake", path, "from . import errors\nfrom .model import Queries\n") == []
    test_path = ROOT / "tests" / "fake.py"
    assert violations("tests.fake", test_path, "import console\nimport shepherd.cli\n") == []
    # Nothing but tests imports tests.
    [bench] = violations("bench.fake", ROOT / "bench" / "fake.py", "from tests.x import y\n")
    assert bench.imported == "tests.x"
