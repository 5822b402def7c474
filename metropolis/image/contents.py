"""What goes into a node image: the node's own packages and the installed
distributions they import, copied into one site-packages folder.

Which distributions: those that provide a top-level module that a ``.py``
file of the bundled packages (`OWN_PACKAGES`) imports, found by parsing the
files (``import`` statements, wherever they stand, TYPE_CHECKING blocks
included) and mapped through ``importlib.metadata.packages_distributions``;
then, transitively, what each requires, with its environment markers
evaluated for this interpreter (and the extras a requirement asks for).
Everything comes from this environment, at the versions installed here,
the ones the tests ran against, so no network and no resolver is needed.
The fleet half (``bmdb``, ``shepherd``) and what only it needs (psycopg,
asyncssh, httpx) stay out, as do dev tools.

The node's own packages are copied from their source folders as a wheel
would ship them (``.py`` files and the package data pyproject.toml names);
a third-party distribution as its RECORD lists it, ``.dist-info``
included (``importlib.metadata`` keeps working inside the image), minus
bytecode and anything outside site-packages (console scripts). Every copied
file gets mode 0644: shiv records each file's mode in the zip, and a build
must not depend on the umask or on how the venv was installed.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from metropolis.image.errors import ImageError

__all__ = [
    "OWN_PACKAGES",
    "copy_distribution",
    "copy_own_package",
    "imported_top_level",
    "package_dir",
    "required_distributions",
]

#: The packages of this repository that a node runs.
OWN_PACKAGES = ("metropolis", "common")

#: Non-Python files of the own packages a wheel ships (pyproject.toml's
#: package-data).
_PACKAGE_DATA = ("*.sql", "*.proto", "py.typed")

_FILE_MODE = 0o644


def package_dir(name: str) -> Path:
    """The source folder of an importable package (without importing it)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImageError(f"package {name} is not importable here")
    return Path(next(iter(spec.submodule_search_locations)))


def _source_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        if path.suffix == ".py" or any(path.match(pattern) for pattern in _PACKAGE_DATA):
            yield path


def imported_top_level(roots: Iterable[Path]) -> set[str]:
    """Top-level names of the absolute imports in every ``.py`` file under ``roots``."""
    names: set[str] = set()
    for root in roots:
        for path in _source_files(root):
            if path.suffix != ".py":
                continue
            tree = ast.parse(path.read_bytes(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names


def required_distributions(modules: Iterable[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions that provide ``modules`` (stdlib and own
    packages left out), and all that they require here, sorted by name.

    Raises `ImageError` if a module or a required distribution is not
    installed.
    """
    providers = importlib.metadata.packages_distributions()
    wanted: list[tuple[str, frozenset[str]]] = []
    for module in sorted(modules):
        if module in sys.stdlib_module_names or module in OWN_PACKAGES or module == "__future__":
            continue
        names = providers.get(module)
        if not names:
            raise ImageError(f"the node imports {module}, which no installed distribution provides")
        wanted += [(name, frozenset()) for name in names]

    found: dict[str, importlib.metadata.Distribution] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    while wanted:
        name, extras = wanted.pop()
        key = (canonicalize_name(name), extras)
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise ImageError(f"{name} is required but not installed here") from None
        found[canonicalize_name(dist.metadata["Name"])] = dist
        for line in dist.requires or []:
            try:
                requirement = Requirement(line)
            except InvalidRequirement as exc:
                raise ImageError(f"{name} declares a bad requirement {line!r}: {exc}") from None
            marker = requirement.marker
            if marker is None or any(
                marker.evaluate({"extra": extra}) for extra in (extras or {""})
            ):
                wanted.append((requirement.name, frozenset(requirement.extras)))
    return [found[name] for name in sorted(found)]


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    target.chmod(_FILE_MODE)


def copy_own_package(name: str, site_packages: Path) -> None:
    """Copy one of `OWN_PACKAGES` from its source folder into ``site_packages``."""
    root = package_dir(name)
    for path in _source_files(root):
        _copy(path, site_packages / name / path.relative_to(root))


def copy_distribution(dist: importlib.metadata.Distribution, site_packages: Path) -> None:
    """Copy the files of an installed distribution that live in its site-packages.

    Raises `ImageError` if it has no RECORD (so its files are unknown).
    """
    files = dist.files
    if files is None:
        raise ImageError(f"{dist.metadata['Name']} has no RECORD: its files are unknown")
    base = Path(str(dist.locate_file(""))).resolve()
    for file in files:
        source = Path(str(dist.locate_file(file))).resolve()
        if not source.is_relative_to(base) or source.suffix == ".pyc":
            continue
        relative = source.relative_to(base)
        if "__pycache__" in relative.parts or relative.parts[0] in OWN_PACKAGES:
            continue
        _copy(source, site_packages / relative)
