"""A cache of built node images, keyed by everything a build reads.

``cache_dir(root, etcd)`` is ``root/<key>/``, where the key is a digest of
the inputs of `metropolis.image.build.build_image`: the own packages'
files (`contents.OWN_PACKAGES`), every installed distribution's name,
version and RECORD, the etcd binary and the Python version. A build from
the same inputs gives the same image, so an image found in that folder
(`cached_image`) can be used instead of building again; changing any
input (a source file, a distribution, etcd) changes the key. Each folder
holds that one image, so it can be served as an image server's image
directory as it is.

Blocking (file reads; `ensure_image` also builds): for a thread, not a
Trio task.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import sys
from pathlib import Path

from metropolis.image import contents
from metropolis.image.build import IMAGE_SUFFIX, build_image

__all__ = ["cache_dir", "cached_image", "ensure_image", "inputs_key"]


def inputs_key(etcd: Path) -> str:
    """A digest of everything a build reads: sources, distributions, etcd, Python."""
    digest = hashlib.sha256()
    for name in contents.OWN_PACKAGES:
        root = contents.package_dir(name)
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: str(d.metadata["Name"])):
        digest.update(f"{dist.metadata['Name']}=={dist.version}\n".encode())
        # Its files' hashes too: an editable install of one version differs
        # by where it points, and several checkouts may share one cache.
        digest.update((dist.read_text("RECORD") or "").encode())
    digest.update(etcd.read_bytes())
    digest.update(sys.version.encode())
    return digest.hexdigest()[:32]


def cache_dir(root: Path, etcd: Path) -> Path:
    """The folder under ``root`` for an image of today's inputs (not created)."""
    return root / inputs_key(etcd)


def cached_image(folder: Path) -> Path | None:
    """The image a build left in ``folder`` (a `cache_dir`), if there is one.

    Only a finished image counts: the builder writes a temporary name and
    renames it once complete.
    """
    built = sorted(p for p in folder.glob(f"*{IMAGE_SUFFIX}") if not p.name.startswith("."))
    return built[0] if built else None


def ensure_image(root: Path, etcd: Path) -> Path:
    """The cached image of today's inputs under ``root``, built first if
    there is none. Raises what `build_image` raises (`ImageError`)."""
    folder = cache_dir(root, etcd)
    folder.mkdir(parents=True, exist_ok=True)
    found = cached_image(folder)
    if found is not None:
        return found
    return build_image(folder, etcd).path
