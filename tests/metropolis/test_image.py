"""The node image: built once per session (cached on disk by its inputs),
then run on Debian's own ``/usr/bin/python3 -I``, which has none of the
project's packages, with a PATH that has no etcd.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import trio

from metropolis.consensus.localetcd import etcd_pid
from metropolis.consensus.process import ETCD_BINARY_ENV, ProcessConfig, Tuning
from metropolis.image.build import IMAGE_SUFFIX, build_image
from metropolis.image.bundle import ETCD_NAME, MANIFEST_NAME, Manifest, bundled_etcd, python_tag
from metropolis.image.errors import ImageError
from metropolis.localstorage import Root
from tests.metropolis.test_node_cli import BOUND, LEADS, NodeProcess, bootstrap_args

SYSTEM_PYTHON = Path("/usr/bin/python3")
ETCD = Path("/usr/bin/etcd")


@pytest.fixture
def image(node_image: Path) -> Path:
    """The session's node image (tests/fixtures/image.py)."""
    return node_image


@pytest.fixture
def bare_path(tmp_path: Path) -> str:
    """A PATH with what the node runs besides etcd (setpriv), and no etcd."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "setpriv").symlink_to("/usr/bin/setpriv")
    return str(bin_dir)


def _bare_env(tmp_path: Path, path: str) -> dict[str, str]:
    return {"PATH": path, "SHIV_ROOT": str(tmp_path / "shiv")}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_image_is_named_by_its_sha256(image: Path) -> None:
    assert image.name == _sha256(image) + IMAGE_SUFFIX


def test_the_image_holds_the_node_and_not_the_fleet_half(image: Path) -> None:
    with zipfile.ZipFile(image) as archive:
        tops = {
            name.split("/")[1] for name in archive.namelist() if name.startswith("site-packages/")
        }
        manifest = Manifest.from_json(
            archive.read(f"site-packages/metropolis/image/_bundle/{MANIFEST_NAME}")
        )
        etcd_info = archive.getinfo(f"site-packages/metropolis/image/_bundle/{ETCD_NAME}")
    assert {"metropolis", "common", "trio", "cryptography", "h2"} <= tops
    assert not {"bmdb", "shepherd", "psycopg", "asyncssh", "httpx", "pytest", "playwright"} & tops
    assert manifest.etcd_sha256 == _sha256(ETCD)
    assert manifest.python == python_tag()
    assert (etcd_info.external_attr >> 16) & 0o777 == 0o755


def test_the_image_carries_its_bytecode_unchecked(image: Path) -> None:
    """Every module of the image has its bytecode beside it, hash-based and
    unchecked (PEP 552 flags 0b01), so that no first start compiles it."""
    tag = sys.implementation.cache_tag
    with zipfile.ZipFile(image) as archive:
        names = set(archive.namelist())
        sources = [
            n for n in names if n.startswith("site-packages/metropolis/") and n.endswith(".py")
        ]
        assert sources
        for source in sources:
            folder, _, file = source.rpartition("/")
            compiled = f"{folder}/__pycache__/{file[:-3]}.{tag}.pyc"
            assert compiled in names, compiled
        header = archive.read(f"site-packages/metropolis/image/__pycache__/entry.{tag}.pyc")[:8]
    assert header[:4] == importlib.util.MAGIC_NUMBER
    assert int.from_bytes(header[4:8], "little") == 0b01


def test_it_runs_on_the_system_python_without_the_project(
    image: Path, tmp_path: Path, bare_path: str
) -> None:
    result = subprocess.run(
        [str(SYSTEM_PYTHON), "-I", str(image), "node", "--help"],
        env=_bare_env(tmp_path, bare_path),
        capture_output=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    assert b"bootstrap" in result.stdout
    assert b"register" in result.stdout


async def test_a_node_bootstraps_from_the_image_with_the_bundled_etcd(
    image: Path, tmp_path: Path, bare_path: str
) -> None:
    env = _bare_env(tmp_path, bare_path)
    # The PATH cannot have supplied the etcd that runs.
    assert not any((Path(d) / "etcd").exists() for d in env["PATH"].split(os.pathsep))
    root = Root(tmp_path / "n")
    process = await trio.lowlevel.open_process(
        [str(SYSTEM_PYTHON), "-I", str(image), "node", *bootstrap_args(tmp_path)],
        stderr=subprocess.PIPE,
        env=env,
    )
    proc = NodeProcess(process)
    try:
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(proc.pump)
                await proc.wait_for(LEADS)
                await proc.wait_for("status pushed")
                pid = etcd_pid(root.ephemeral.consensus)
                assert pid is not None
                # /proc reads do not block.
                exe = Path(os.readlink(f"/proc/{pid}/exe"))
                assert exe.is_relative_to(tmp_path / "shiv"), exe
                assert exe.name == ETCD_NAME
                assert _sha256(exe) == _sha256(ETCD)
                process.send_signal(signal.SIGTERM)
                await process.wait()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert process.returncode == 0, "\n".join(proc.lines)
    assert etcd_pid(root.ephemeral.consensus) is None


def test_two_builds_of_the_same_sources_are_the_same_bytes(image: Path, tmp_path: Path) -> None:
    again = build_image(tmp_path, ETCD)
    assert again.path.name == image.name
    assert again.path.read_bytes() == image.read_bytes()
    # Written atomically: no temp file is left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == [image.name]


def _cli(*args: str, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*(prefix or []), sys.executable, "-m", "metropolis.image", "build", *args],
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.parametrize("etcd", ["missing", "not-executable", "not-etcd"])
def test_a_bad_etcd_is_one_clear_line(tmp_path: Path, etcd: str) -> None:
    path = tmp_path / etcd
    if etcd == "not-executable":
        path.write_bytes(ETCD.read_bytes()[:4096])
    elif etcd == "not-etcd":
        path.symlink_to("/bin/true")
    result = _cli("--out", str(tmp_path), "--etcd", str(path))
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"metropolis image: --etcd {path}: ")
    assert result.stdout == ""
    assert not list(tmp_path.glob(f"*{IMAGE_SUFFIX}"))


def test_an_unwritable_out_is_one_clear_line(tmp_path: Path) -> None:
    out = tmp_path / "ro"
    out.mkdir(mode=0o555)
    # Root writes anywhere by CAP_DAC_OVERRIDE: without it (dropped from the
    # bounding set before exec), root too must obey the directory's mode.
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
    result = _cli("--out", str(out), "--etcd", str(ETCD), prefix=drop if os.geteuid() == 0 else [])
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"metropolis image: --out {out}: cannot write there (Permission denied)"
    ]
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("kind", ["missing", "a-file"])
def test_an_out_that_is_no_directory_is_one_clear_line(tmp_path: Path, kind: str) -> None:
    out = tmp_path / "out"
    if kind == "a-file":
        out.write_text("")
    result = _cli("--out", str(out), "--etcd", str(ETCD))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"metropolis image: --out {out}: not a directory"]


def test_etcd_is_taken_from_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ProcessConfig.standalone("n", Path("/x"), 1234, Tuning())
    monkeypatch.delenv(ETCD_BINARY_ENV, raising=False)
    assert config.argv()[0] == "etcd"
    monkeypatch.setenv(ETCD_BINARY_ENV, "/opt/image/etcd")
    assert config.argv()[0] == "/opt/image/etcd"


def _bundle(tmp_path: Path, etcd: bytes, python: str) -> Path:
    bundle = tmp_path / "_bundle"
    bundle.mkdir(parents=True)
    (bundle / ETCD_NAME).write_bytes(etcd)
    (bundle / ETCD_NAME).chmod(0o755)
    manifest = Manifest(
        etcd_sha256=hashlib.sha256(b"the real etcd").hexdigest(), etcd_version="3.4", python=python
    )
    (bundle / MANIFEST_NAME).write_bytes(manifest.to_json())
    return bundle


def test_the_bundled_etcd_is_checked_against_the_manifest(tmp_path: Path) -> None:
    assert bundled_etcd(tmp_path / "none") is None
    good = _bundle(tmp_path / "good", b"the real etcd", python_tag())
    assert bundled_etcd(good) == good / ETCD_NAME
    damaged = _bundle(tmp_path / "damaged", b"the real etc", python_tag())
    with pytest.raises(ImageError, match="SHIV_FORCE_EXTRACT=1"):
        bundled_etcd(damaged)
    other_python = _bundle(tmp_path / "py", b"the real etcd", "3.99")
    with pytest.raises(ImageError, match=r"built for Python 3\.99"):
        bundled_etcd(other_python)
