"""What a running image bundles besides Python code: the etcd binary, and
the manifest that says what it must be.

Inside an image, shiv extracts ``site-packages`` (with each file's mode:
etcd stays 0755) to its cache, ``~/.shiv/<image>_<build id>/`` or under
``$SHIV_ROOT``, once, on first start. This package's ``_bundle/`` folder is
then there, next to this module::

    metropolis/image/_bundle/
        etcd            the etcd binary the builder was given
        manifest.json   {"etcd_sha256": ..., "etcd_version": ..., "python": "3.11"}

Outside an image ``_bundle/`` does not exist: :func:`bundled_etcd` returns
None and the node runs ``etcd`` from PATH as usual.

The digest check at every start catches a damaged or replaced cache (a
half-copied file, a disk error, someone's edit). It is no defence against
whoever can write the cache: they could change the extracted Python code
as well. The image file itself is what is verified (its SHA-256 is its
name) before it is run.

Imports only the standard library and the package's errors:
:mod:`metropolis.image.entry` runs this before it imports any compiled
dependency.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from metropolis.image.errors import ImageError

__all__ = [
    "BUNDLE_DIR",
    "ETCD_NAME",
    "MANIFEST_NAME",
    "Manifest",
    "bundled_etcd",
    "file_sha256",
    "python_tag",
]

#: Where the bundle sits inside the image's site-packages (and, extracted,
#: next to this module).
BUNDLE_DIR = Path(__file__).parent / "_bundle"
#: The bundled binary keeps etcd's own name: the kernel's comm of the
#: process is then ``etcd``, which is how tools find a node's etcd in /proc.
ETCD_NAME = "etcd"
MANIFEST_NAME = "manifest.json"

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Manifest:
    """What the builder recorded about the bundle."""

    etcd_sha256: str
    etcd_version: str
    #: ``major.minor`` of the Python that built the image: compiled
    #: dependencies (cryptography, cffi) only load on the same minor.
    python: str

    def to_json(self) -> bytes:
        fields = {
            "etcd_sha256": self.etcd_sha256,
            "etcd_version": self.etcd_version,
            "python": self.python,
        }
        return (json.dumps(fields, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        try:
            fields = json.loads(data)
            return cls(
                etcd_sha256=str(fields["etcd_sha256"]),
                etcd_version=str(fields["etcd_version"]),
                python=str(fields["python"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ImageError(f"the image's {MANIFEST_NAME} is damaged: {exc}") from None


def python_tag() -> str:
    """``major.minor`` of the running Python."""
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def bundled_etcd(bundle_dir: Path = BUNDLE_DIR) -> Path | None:
    """The bundled etcd, checked against the manifest; None outside an image.

    Raises `ImageError` if this Python is not the minor the image was built
    for, or if the etcd file is missing, not executable or not the bytes the
    manifest names (``SHIV_FORCE_EXTRACT=1`` for one start extracts
    the image again).
    """
    manifest_path = bundle_dir / MANIFEST_NAME
    if not manifest_path.exists():
        return None
    manifest = Manifest.from_json(manifest_path.read_bytes())
    if manifest.python != python_tag():
        raise ImageError(
            f"this image was built for Python {manifest.python}, "
            f"not {python_tag()} ({sys.executable})"
        )
    etcd = bundle_dir / ETCD_NAME
    fix = "run once with SHIV_FORCE_EXTRACT=1 to extract the image again"
    try:
        digest = file_sha256(etcd)
    except OSError as exc:
        raise ImageError(
            f"the bundled etcd {etcd} cannot be read ({exc.strerror}): {fix}"
        ) from None
    if digest != manifest.etcd_sha256:
        raise ImageError(
            f"the bundled etcd {etcd} has SHA-256 {digest}, "
            f"not {manifest.etcd_sha256} as the image says: {fix}"
        )
    if not os.access(etcd, os.X_OK):
        raise ImageError(f"the bundled etcd {etcd} is not executable: {fix}")
    return etcd
