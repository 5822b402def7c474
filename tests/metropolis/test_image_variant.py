"""A second release of a built node image (`metropolis.image.variant`).

The variant runs on Debian's own python3 as the image does, under another
name and digest, and unpacks into a shiv cache folder of its own (a new
build id), and into a folder of its own beside the original's when the
boot helper unpacks it (`shepherd.agent.unpack`), from which it runs.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from metropolis.image.errors import ImageError
from metropolis.image.variant import release_variant
from shepherd.agent import unpack


def _build_id(image: Path) -> str:
    with zipfile.ZipFile(image) as archive:
        return str(json.loads(archive.read("environment.json"))["build_id"])


def test_a_variant_is_another_release_of_the_same_node(node_image: Path, tmp_path: Path) -> None:
    variant = release_variant(node_image, "a second release", tmp_path)
    data = variant.read_bytes()
    assert variant.name == hashlib.sha256(data).hexdigest() + ".pyz"
    assert variant.name != node_image.name
    assert data.splitlines()[1] == b"# a second release"
    assert _build_id(variant) != _build_id(node_image)
    # The same files otherwise, each byte for byte.
    with zipfile.ZipFile(node_image) as a, zipfile.ZipFile(variant) as b:
        assert a.namelist() == b.namelist()
        for name in a.namelist():
            if name != "environment.json":
                assert a.read(name) == b.read(name), name
    # It runs on the system's Python, and unpacks apart from the original.
    shiv = tmp_path / "shiv"
    for image in (node_image, variant):
        run = subprocess.run(
            ["/usr/bin/python3", "-I", str(image), "node", "--help"],
            env={"PATH": "/usr/bin:/bin", "SHIV_ROOT": str(shiv)},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        assert "usage: metropolis node" in run.stdout
    assert sorted(p.name for p in shiv.iterdir() if p.is_dir()) == sorted(
        [f"{node_image.name}_{_build_id(node_image)}", f"{variant.name}_{_build_id(variant)}"]
    )


def test_a_variant_of_what_is_no_shiv_image_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain.pyz"
    plain.write_bytes(b"#!/usr/bin/env python3\nnot a zip\n")
    with pytest.raises(ImageError, match="is not a shiv image"):
        release_variant(plain, "x", tmp_path)
    with pytest.raises(ImageError, match="one printable line"):
        release_variant(plain, "two\nlines", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.pyz"]


def test_a_variant_unpacks_beside_the_original_and_runs_from_its_folder(
    node_image: Path, tmp_path: Path
) -> None:
    variant = release_variant(node_image, "unpacked", tmp_path)
    cache = tmp_path / "cache"
    digests = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (node_image, variant)]
    for image, digest in zip((node_image, variant), digests, strict=True):
        unpack.ensure(str(image), digest, str(cache))
    assert sorted(p.name for p in cache.iterdir()) == sorted(digests)
    run = subprocess.run(
        ["/usr/bin/python3", "-I", str(cache / digests[1]), "node", "--help"],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage: metropolis node" in run.stdout
    # The boot keeps the chosen image's folder alone.
    unpack.prune(str(cache), keep=digests[1])
    assert [p.name for p in cache.iterdir()] == [digests[1]]
