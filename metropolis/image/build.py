"""Build a node image: one zipapp named by its SHA-256, made by shiv.

Why shiv, not pex: shiv builds straight from an existing site-packages
folder (``--site-packages``), so the image is packed offline from exactly
the distributions installed and tested here (:mod:`metropolis.image.contents`
copies them), with no resolver, index or wheel cache involved; pex builds
from requirements or wheels it resolves itself, which offline means
keeping a wheelhouse for every dependency (cryptography and cffi
included). shiv's runtime is a few stdlib-only modules, its ``--reproducible``
fixes every timestamp (and its build id is the SHA-256 of the contents), so
the same inputs give the same bytes, and it extracts site-packages to a
cache once (``~/.shiv`` or ``$SHIV_ROOT``) keeping each file's mode, which
is what a bundled executable (etcd) needs. pex would work too; it is the
larger tool for a job that needs less.

The steps::

    check --etcd (a file that answers ``--version`` as etcd)
      -> temp file in --out (fails early if --out is not writable)
      -> site-packages in a temp dir: metropolis, common, the distributions
         they import (contents.py), _bundle/etcd (0755) + manifest.json
      -> their bytecode compiled (hash-based, unchecked) beside them
      -> python -m shiv --site-packages ... --reproducible, then the bytecode
         added to its zip (shiv leaves .pyc files out)
      -> SHA-256 of the file -> fsync -> rename to OUT/<sha256>.pyz -> fsync OUT

The bytecode is compiled here, once, and carried by the image (about a
fifth more bytes), not at the node's first start: shiv's ``--compile-pyc``
did it there, on the node's critical path, some seconds of CPU on a
loaded machine, and each machine paid it. The files are hash-based and
unchecked (PEP 552): they hold no timestamp (the build stays
reproducible, and a file extracted later with another mtime still
matches), and Python trusts them without reading the source, which is
what an image that never changes wants. The entry point is
:func:`metropolis.image.entry.main`. The image runs on the Python minor
version that built it (compiled dependencies are built for it, and so is
the bytecode): Debian 12's 3.11 for this project.

Blocking (subprocesses, file I/O): a command-line tool's code, not for a
Trio task.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from metropolis.image import contents
from metropolis.image.bundle import ETCD_NAME, MANIFEST_NAME, Manifest, file_sha256, python_tag
from metropolis.image.errors import ImageError

__all__ = ["IMAGE_SUFFIX", "BuiltImage", "build_image", "default_etcd", "etcd_version"]

log = logging.getLogger("metropolis.image.build")

#: A zipapp: ``python3 FILE`` runs it.
IMAGE_SUFFIX = ".pyz"
#: The import path of the bundle folder inside site-packages.
_BUNDLE = Path("metropolis", "image", "_bundle")
_ENTRY_POINT = "metropolis.image.entry:main"
_ETCD_VERSION_TIMEOUT = 30.0
_CHUNK = 1 << 20


@dataclass(frozen=True)
class BuiltImage:
    """An image just built, and what the builder's output line reports."""

    path: Path
    sha256: str
    size: int
    #: Wall-clock seconds the build took.
    seconds: float
    etcd_version: str
    distributions: tuple[str, ...]


def default_etcd() -> Path:
    """The etcd a node outside an image would run: the one on PATH."""
    found = shutil.which("etcd")
    if found is None:
        raise ImageError("no etcd on PATH: install Debian's etcd-server or pass --etcd PATH")
    return Path(found)


def etcd_version(etcd: Path) -> str:
    """What ``etcd --version`` says its version is; `ImageError` if it is no etcd."""
    if not etcd.is_file():
        raise ImageError(f"--etcd {etcd}: no such file")
    if not os.access(etcd, os.X_OK):
        raise ImageError(f"--etcd {etcd}: not executable")
    try:
        result = subprocess.run(
            [str(etcd), "--version"],
            capture_output=True,
            timeout=_ETCD_VERSION_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ImageError(f"--etcd {etcd}: does not run ({exc})") from None
    first = result.stdout.decode(errors="replace").partition("\n")[0]
    prefix = "etcd Version: "
    if result.returncode != 0 or not first.startswith(prefix):
        raise ImageError(f"--etcd {etcd}: not an etcd binary (--version said {first!r})")
    return first.removeprefix(prefix).strip()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _assemble(site_packages: Path, etcd: Path, version: str) -> tuple[str, ...]:
    """Fill ``site_packages``; return the third-party distributions it holds."""
    roots = [contents.package_dir(name) for name in contents.OWN_PACKAGES]
    dists = contents.required_distributions(contents.imported_top_level(roots))
    for name in contents.OWN_PACKAGES:
        contents.copy_own_package(name, site_packages)
    for dist in dists:
        contents.copy_distribution(dist, site_packages)
    bundle = site_packages / _BUNDLE
    bundle.mkdir(parents=True)
    shutil.copyfile(etcd, bundle / ETCD_NAME)
    (bundle / ETCD_NAME).chmod(0o755)
    manifest = Manifest(
        etcd_sha256=file_sha256(bundle / ETCD_NAME), etcd_version=version, python=python_tag()
    )
    (bundle / MANIFEST_NAME).write_bytes(manifest.to_json())
    (bundle / MANIFEST_NAME).chmod(0o644)
    return tuple(f"{d.metadata['Name']}=={d.version}" for d in dists)


def _compile(site_packages: Path) -> None:
    """Compile every module's bytecode beside it (see the module docstring).

    Named as the image's own paths (``site-packages/...``), not this
    temporary folder's, so the bytes do not depend on where it was built;
    Python names the code by the file it imports it from anyway. A file
    that does not compile (a package's Python 2 example) is left without
    bytecode, as shiv's own compile leaves it.
    """
    # In a process of its own, isolated (-I): PYTHONPYCACHEPREFIX, where it
    # is set (the test sessions set it), would send the files there
    # instead of beside the modules; and workers fork, which this
    # process's threads make unsafe.
    result = subprocess.run(
        [sys.executable, "-I", "-c", _COMPILE, str(site_packages)],
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        said = result.stderr.decode(errors="replace").strip().splitlines()
        raise ImageError(f"compiling the bytecode failed: {said[-1] if said else ''}")


_COMPILE = """
import compileall, py_compile, sys
compileall.compile_dir(
    sys.argv[1], ddir="site-packages", quiet=2, workers=0, force=True,
    invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
)
"""


def _add_bytecode(site_packages: Path, image: Path) -> None:
    """Add the compiled bytecode to the zipapp shiv built (shiv leaves every
    ``.pyc`` out), in a fixed order with shiv's fixed time, so that the
    build stays reproducible."""
    compiled = sorted(site_packages.rglob("*.pyc"), key=lambda p: str(p.relative_to(site_packages)))
    with zipfile.ZipFile(image, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        stamp = archive.getinfo("environment.json").date_time
        for path in compiled:
            info = zipfile.ZipInfo(f"site-packages/{path.relative_to(site_packages)}", stamp)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, path.read_bytes())


def _shiv(site_packages: Path, output: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "shiv",
        "--site-packages",
        str(site_packages),
        "--entry-point",
        _ENTRY_POINT,
        "--output-file",
        str(output),
        "--python",
        "/usr/bin/env python3",
        "--reproducible",
    ]
    result = subprocess.run(argv, capture_output=True, check=False)
    if result.returncode != 0:
        said = result.stderr.decode(errors="replace").strip().splitlines()
        raise ImageError(f"shiv failed (exit {result.returncode}): {said[-1] if said else ''}")


def build_image(out_dir: Path, etcd: Path | None = None) -> BuiltImage:
    """Build an image into ``out_dir`` as ``<sha256>.pyz``; return what was built.

    The file appears whole or not at all (temp file in ``out_dir``, renamed
    once complete). An existing image of the same digest is replaced by
    identical bytes. Raises `ImageError` (one line) for a bad ``etcd``, an
    ``out_dir`` that is missing or not writable, or a failed build.
    """
    started = time.monotonic()
    etcd = etcd if etcd is not None else default_etcd()
    version = etcd_version(etcd)
    if not out_dir.is_dir():
        raise ImageError(f"--out {out_dir}: not a directory")
    try:
        fd, temp_name = tempfile.mkstemp(prefix=".image-", suffix=IMAGE_SUFFIX, dir=out_dir)
    except OSError as exc:
        raise ImageError(f"--out {out_dir}: cannot write there ({exc.strerror})") from None
    os.close(fd)
    temp = Path(temp_name)
    try:
        with tempfile.TemporaryDirectory(prefix="metropolis-image-") as work:
            site_packages = Path(work, "site-packages")
            site_packages.mkdir()
            try:
                distributions = _assemble(site_packages, etcd, version)
            except OSError as exc:
                raise ImageError(f"cannot assemble the image's files: {exc}") from None
            _compile(site_packages)
            _shiv(site_packages, temp)
            _add_bytecode(site_packages, temp)
        digest = hashlib.sha256()
        with temp.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
            os.fsync(f.fileno())
        sha256 = digest.hexdigest()
        final = out_dir / f"{sha256}{IMAGE_SUFFIX}"
        os.replace(temp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        raise
    _fsync_dir(out_dir)
    image = BuiltImage(
        path=final,
        sha256=sha256,
        size=final.stat().st_size,
        seconds=time.monotonic() - started,
        etcd_version=version,
        distributions=distributions,
    )
    log.info("built %s (%d bytes) in %.1f s", final, image.size, image.seconds)
    return image
