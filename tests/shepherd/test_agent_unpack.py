"""The node image unpacked into files (`shepherd.agent.unpack`): the node
runs from them on the system's Python with the image's own bytecode; a
folder cut short is unpacked again; other images' folders are removed;
an image that would write outside its folder, or is no shiv zipapp, is
refused with nothing left."""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from shepherd.agent import unpack


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _compiled(folder: Path) -> dict[Path, int]:
    """The image's bytecode files (the launcher's own aside) and their times."""
    return {p: p.stat().st_mtime_ns for p in (folder / "site-packages").rglob("*.pyc")}


def test_the_node_runs_from_the_unpacked_image_with_its_own_bytecode(
    node_image: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    folder = Path(unpack.ensure(str(node_image), _digest(node_image), str(cache)))
    assert folder == cache / _digest(node_image) and unpack.complete(str(folder))
    etcd = folder / "site-packages/metropolis/image/_bundle/etcd"
    assert etcd.stat().st_mode & 0o777 == 0o755
    before = _compiled(folder)
    assert before
    # The system's Python, nothing of the project's environment: what the
    # node unit runs. Bytecode may be written (as on a machine).
    done = subprocess.run(
        ["/usr/bin/python3", str(folder), "node", "register", "--help"],
        capture_output=True,
        env={"PATH": "/usr/bin:/bin"},
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert b"usage:" in done.stdout
    # Every module it imported came with its bytecode: none compiled, none rewritten.
    assert _compiled(folder) == before


def test_a_folder_cut_short_is_unpacked_again(node_image: Path, tmp_path: Path) -> None:
    cache, digest = tmp_path / "cache", _digest(node_image)
    folder = Path(unpack.ensure(str(node_image), digest, str(cache)))
    entry = folder / "site-packages/metropolis/image/entry.py"
    size = entry.stat().st_size
    entry.write_bytes(b"")  # as a power loss right after the rename leaves a file
    assert not unpack.complete(str(folder))
    unpack.ensure(str(node_image), digest, str(cache))
    assert entry.stat().st_size == size and unpack.complete(str(folder))


def test_a_complete_folder_is_left_as_it_is(node_image: Path, tmp_path: Path) -> None:
    cache, digest = tmp_path / "cache", _digest(node_image)
    folder = Path(unpack.ensure(str(node_image), digest, str(cache)))
    marker = folder / "site-packages" / "running-node-was-here"
    marker.write_bytes(b"")
    unpack.ensure(str(node_image), digest, str(cache))
    assert marker.exists()


def test_other_images_folders_are_pruned_but_not_one_being_unpacked(
    node_image: Path, tmp_path: Path
) -> None:
    cache, digest = tmp_path / "cache", _digest(node_image)
    old = cache / ("ab" * 32)
    dead = cache / f"{'cd' * 32}.999999999.tmp"
    live = cache / f"{'ef' * 32}.{os.getpid()}.tmp"
    for folder in (old, dead, live):
        folder.mkdir(parents=True)
    unpack.ensure(str(node_image), digest, str(cache))
    assert old.exists()  # not asked to prune: the agent's call
    unpack.ensure(str(node_image), digest, str(cache), prune_others=True)
    assert sorted(p.name for p in cache.iterdir()) == sorted([digest, live.name])


def _shiv_like(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("environment.json", b'{"entry_point": "pkg.main:run"}')
        for name, data in members.items():
            archive.writestr(name, data)


@pytest.mark.parametrize(
    "name", ["site-packages/../escape.py", "site-packages/a/../../escape.py", "site-packages//x"]
)
def test_a_member_outside_the_folder_is_refused(tmp_path: Path, name: str) -> None:
    image = tmp_path / "image.pyz"
    _shiv_like(image, {"site-packages/pkg/__init__.py": b"", name: b"x"})
    cache = tmp_path / "cache"
    with pytest.raises(unpack.UnpackError, match="escapes"):
        unpack.unpack(str(image), _digest(image), str(cache))
    assert list(cache.iterdir()) == []
    assert not (tmp_path / "escape.py").exists()


def test_no_shiv_zipapp_is_refused(tmp_path: Path) -> None:
    image = tmp_path / "image.pyz"
    with zipfile.ZipFile(image, "w") as archive:
        archive.writestr("site-packages/pkg/__init__.py", b"")
    with pytest.raises(unpack.UnpackError, match="entry point"):
        unpack.unpack(str(image), _digest(image), str(tmp_path / "cache"))
    not_a_zip = tmp_path / "junk.pyz"
    not_a_zip.write_bytes(b"not a zip")
    with pytest.raises(unpack.UnpackError):
        unpack.unpack(str(not_a_zip), _digest(not_a_zip), str(tmp_path / "cache"))
    assert list((tmp_path / "cache").iterdir()) == []
    with pytest.raises(unpack.UnpackError, match="SHA-256"):
        unpack.tree("../../etc", str(tmp_path))


def test_the_folders_it_makes_are_root_s_alone(node_image: Path, tmp_path: Path) -> None:
    """/run/metropolis holds the node's parameters too: made here first, it
    must be no more open than the boot helper makes it (0700)."""
    cache = tmp_path / "run" / "metropolis" / "images"
    unpack.ensure(str(node_image), _digest(node_image), str(cache))
    for folder in (tmp_path / "run", tmp_path / "run" / "metropolis", cache):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
