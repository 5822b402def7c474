"""A second node image from a built one: the same node, a new release to upgrade to.

`release_variant` copies an image (a shiv zipapp, `metropolis.image.build`)
with a new shiv build id in its ``environment.json`` and a comment line
naming ``label`` after its shebang, and names it by its own SHA-256. Shiv
extracts an image's site-packages into a cache folder named by the build id,
and an installed machine unpacks an image into a folder named by its digest
(``shepherd/agent/unpack.py``), so the variant is unpacked anew at its first
start, as a new release is; its digest differs, which is what an upgrade
moves.
For the demo's and the benchmark's upgrades, which need a second image
without a second build (minutes of CPU).

Blocking (file I/O): for a thread, not a Trio task. `ImageError` if the
file is not a shiv image.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

from metropolis.image.build import IMAGE_SUFFIX
from metropolis.image.errors import ImageError

__all__ = ["release_variant"]

#: Shiv's record of how the image runs, at the root of the archive.
ENVIRONMENT = "environment.json"


def release_variant(image: Path, label: str, out_dir: Path) -> Path:
    """``image`` as another release (see the module), written into ``out_dir``
    as ``<sha256>.pyz``; its path. The label must be one printable line."""
    if not label.isprintable():
        raise ImageError(f"a variant's label must be one printable line, got {label!r}")
    data = image.read_bytes()
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        environment = json.loads(archive.read(ENVIRONMENT))
        old = str(environment["build_id"])
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError) as e:
        raise ImageError(f"{image} is not a shiv image: {e}") from e
    environment["build_id"] = hashlib.sha256(f"{old}\0{label}".encode()).hexdigest()
    out = io.BytesIO()
    newline = data.index(b"\n") + 1 if data.startswith(b"#!") else 0
    out.write(data[:newline] + f"# {label}\n".encode())
    with zipfile.ZipFile(out, "a") as copy:
        for info in archive.infolist():
            body = archive.read(info)
            if info.filename == ENVIRONMENT:
                body = json.dumps(environment).encode()
            copy.writestr(info, body)
    variant = out.getvalue()
    path = out_dir / f"{hashlib.sha256(variant).hexdigest()}{IMAGE_SUFFIX}"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(variant)
    tmp.chmod(image.stat().st_mode & 0o777)
    tmp.replace(path)
    return path
