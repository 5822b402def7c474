"""A second release of a built node image (`metropolis.image.variant`), and the
agent's prewarm of a new image (`shepherd.agent.upgrade.prewarm_device`).

The variant runs on Debian's own python3 as the image does, under another
name and digest, and unpacks into a shiv cache folder of its own (a new
build id); the prewarm leaves that folder where the node unit will look
for it, under the name the unit runs the image by.
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
from shepherd.agent import blockdev
from shepherd.agent.upgrade import prewarm_device


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


def test_the_agent_prewarms_a_new_image_where_the_node_unit_runs_it(
    node_image: Path, tmp_path: Path
) -> None:
    variant = release_variant(node_image, "prewarmed", tmp_path)
    download = tmp_path / ".image-download.part"  # as the agent's download names it
    download.write_bytes(variant.read_bytes())
    target = blockdev.Target(shiv_root=str(tmp_path / "shiv"), python="/usr/bin/python3")
    prewarm_device(str(download), target)
    # The unit runs /run/metropolis/image.pyz: shiv's folder is named by that
    # file name and the build id, whatever the download was called.
    unpacked = tmp_path / "shiv" / f"image.pyz_{_build_id(variant)}"
    assert (unpacked / "site-packages" / "metropolis").is_dir()
    assert download.read_bytes() == variant.read_bytes()  # left as it was
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".prewarm-")) == []
