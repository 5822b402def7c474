"""``python -m metropolis node``: bootstrap, stop, SIGKILL, run again; crash mid-bootstrap.

Each node is a real process with a real etcd child. The tests read the
node's log (stderr) to know when its curator leads, and /proc to find its
etcd, so that an orphaned etcd is caught by pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from common.net import free_loopback_port
from metropolis import pki
from metropolis.consensus.client import Client
from metropolis.consensus.localetcd import etcd_pid
from metropolis.consensus.process import SOCKET_NAME
from metropolis.identity import NodeCredentials
from metropolis.localstorage import Root
from metropolis.proto.management import GetClusterInfoResponse
from metropolis.roleserve import disk
from metropolis.roleserve.controlplane import CRASH_ENV
from metropolis.roleserve.values import RegisterIntent

BOUND = 120
LEADS = "this curator leads"


class NodeProcess:
    """A running ``metropolis node`` process and the lines it has logged."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self._changed = trio.Event()

    async def pump(self) -> None:
        assert self.process.stderr is not None
        buffer = b""
        async for chunk in self.process.stderr:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            self.lines += [line.decode(errors="replace") for line in lines]
            self._changed.set()
            self._changed = trio.Event()
        self._changed.set()

    async def wait_for(self, text: str) -> None:
        while not any(text in line for line in self.lines):
            if self.process.returncode is not None:
                raise AssertionError(f"node exited before {text!r}:\n" + "\n".join(self.lines))
            with trio.move_on_after(0.5):
                await self._changed.wait()

    def logged(self, text: str) -> bool:
        return any(text in line for line in self.lines)


@asynccontextmanager
async def node(
    *args: str, env: dict[str, str] | None = None, own_group: bool = False
) -> AsyncIterator[NodeProcess]:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "metropolis", "node", *args],
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
        # As a shell runs it: the node leads a process group of its own.
        start_new_session=own_group,
    )
    proc = NodeProcess(process)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proc.pump)
            yield proc
            with trio.fail_after(BOUND):
                await process.wait()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()


def bootstrap_args(tmp_path: Path) -> list[str]:
    return [
        "bootstrap",
        "--root",
        str(tmp_path / "n"),
        "--address",
        "127.0.0.1",
        "--owner-key-out",
        str(tmp_path / "owner.pem"),
        "--insecure-seal",
        "--peer-port",
        str(free_loopback_port()),
        "--curator-port",
        str(free_loopback_port()),
        "--debug-port",
        str(free_loopback_port()),
        "--raft-tuning",
        "20,200",
    ]


async def _wait_no_etcd(root: Root) -> None:
    while True:
        if etcd_pid(root.ephemeral.consensus) is None:
            return
        await trio.sleep(0.05)


def _identity(root: Root) -> tuple[str, bytes, bytes]:
    """Node ID, node certificate and CA certificate, as saved."""
    credentials = NodeCredentials.load(root.data.node_credentials)
    der = pki.Encoding.DER
    return (
        credentials.node_id,
        pki.encode_certificate(credentials.certificate, der),
        pki.encode_certificate(credentials.ca_certificate, der),
    )


async def _curator_keys(root: Root) -> list[bytes]:
    async with Client(root.ephemeral.consensus / SOCKET_NAME) as etcd:
        result = await etcd.range(b"namespaced/curator/", prefix=True)
    return [kv.key for kv in result.kvs if not kv.key.endswith(b"/leader")]


async def test_bootstrap_then_run_after_clean_stop_and_after_sigkill(tmp_path: Path) -> None:
    root = Root(tmp_path / "n")
    with trio.fail_after(BOUND):
        async with node(*bootstrap_args(tmp_path)) as first:
            await first.wait_for(LEADS)
            # Logs carry the supervisor's dotted names.
            assert first.logged(" root.role.controlplane.launcher.curator: ")
            assert first.logged(" root.role.controlplane.launcher.consensus.etcd: ")
            # The first status push writes the node's heartbeat key; keys
            # taken before it would race the push.
            await first.wait_for("status pushed")
            keys = await _curator_keys(root)
            identity = _identity(root)
            first.process.send_signal(signal.SIGTERM)
        assert first.process.returncode == 0
        assert etcd_pid(root.ephemeral.consensus) is None
        assert (tmp_path / "owner.pem").stat().st_mode & 0o777 == 0o600

        # A clean restart: same identity, no second bootstrap, same keys.
        async with node("run", "--root", str(root.path)) as second:
            await second.wait_for(LEADS)
            assert not second.logged("bootstrapping")
            assert await _curator_keys(root) == keys
            assert _identity(root) == identity
            pid = etcd_pid(root.ephemeral.consensus)
            assert pid is not None
            second.process.send_signal(signal.SIGKILL)
        # etcd goes with its parent, even on SIGKILL.
        await _wait_no_etcd(root)

        async with node("run", "--root", str(root.path)) as third:
            await third.wait_for(LEADS)
            assert not third.logged("bootstrapping")
            assert await _curator_keys(root) == keys
            assert _identity(root) == identity
            third.process.send_signal(signal.SIGINT)
        assert third.process.returncode == 0
        assert etcd_pid(root.ephemeral.consensus) is None


async def test_ctrl_c_to_the_whole_process_group_stops_cleanly(tmp_path: Path) -> None:
    """Ctrl-C in a terminal signals the node's whole process group.

    etcd must not get that SIGINT itself: it would exit under the running
    consensus service, which then logs a failure while the node stops.
    """
    root = Root(tmp_path / "n")
    with trio.fail_after(BOUND):
        async with node(*bootstrap_args(tmp_path), own_group=True) as proc:
            await proc.wait_for(LEADS)
            await proc.wait_for("status pushed")
            os.killpg(proc.process.pid, signal.SIGINT)
        assert proc.process.returncode == 0
        assert etcd_pid(root.ephemeral.consensus) is None
        errors = [line for line in proc.lines if " ERROR " in line]
        assert errors == []


@pytest.mark.parametrize("step", ["after-bootstrap-cluster", "finish-credentials-staged"])
async def test_a_crash_mid_bootstrap_resumes(tmp_path: Path, step: str) -> None:
    root = Root(tmp_path / "n")
    staged = disk.staged_credentials_path(root)
    with trio.fail_after(BOUND):
        # The cluster is created in etcd, then the node dies before its
        # credentials are in place: right away, or with them staged, just
        # before the rename that commits them.
        async with node(*bootstrap_args(tmp_path), env={CRASH_ENV: step}) as crashed:
            pass
        assert crashed.process.returncode == -signal.SIGKILL
        await _wait_no_etcd(root)
        assert not root.data.node_credentials.all_present()
        assert disk.bootstrap_path(root).exists()
        # Staged while etcd started, so there either way; fsynced.
        assert staged.all_present()

        async with node("run", "--root", str(root.path)) as resumed:
            await resumed.wait_for(LEADS)
            # The PKI is in etcd already: the join data comes from etcd this time.
            assert resumed.logged("bootstrapping: creating the cluster")
            await resumed.wait_for("status pushed")
            # CA certificate and key, the node's issued certificate, initial
            # owner, join key, node record and its heartbeat: once each.
            keys = await _curator_keys(root)
            assert len(keys) == 7 and len(set(keys)) == 7
            async with Client(root.ephemeral.consensus / SOCKET_NAME) as etcd:
                stored = await etcd.get(b"namespaced/curator//cluster-pki/ca/certificate")
            credentials = NodeCredentials.load(root.data.node_credentials)
            assert stored is not None
            assert stored.value == pki.encode_certificate(
                credentials.ca_certificate, pki.Encoding.DER
            )
            resumed.process.send_signal(signal.SIGTERM)
        assert not disk.bootstrap_path(root).exists()
        # The crashed attempt's cluster won: the resumed one staged its
        # credentials anew and renamed them into place.
        assert not staged.path.exists()


@pytest.mark.parametrize("damage", ["missing", "foreign", "half-written"])
def test_run_refuses_a_bad_root(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "n"
    if damage == "foreign":
        root.mkdir()
        (root / "something").write_text("not a node")
    elif damage == "half-written":
        # Settings without an intent: a registration's crash between the two.
        settings = disk.NodeSettings(address="127.0.0.1", peer_port=1)
        intent = RegisterIntent.generate(b"ticket", GetClusterInfoResponse())
        disk.save_register_intent(Root(root), settings, intent)
        disk.register_path(Root(root)).unlink()
    result = subprocess.run(
        [sys.executable, "-m", "metropolis", "node", "run", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    assert result.returncode == 2
    expected = {
        "missing": "no such directory",
        "foreign": "not a node's root",
        "half-written": "half-written",
    }[damage]
    assert expected in result.stderr


def test_bootstrap_refuses_a_used_root_and_needs_insecure_seal(tmp_path: Path) -> None:
    args = bootstrap_args(tmp_path)
    used = tmp_path / "n"
    used.mkdir()
    (used / "data").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "metropolis", "node", *args],
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    assert result.returncode == 2 and "not empty" in result.stderr

    no_seal = [a for a in args if a != "--insecure-seal"]
    no_seal[no_seal.index("--root") + 1] = str(tmp_path / "fresh")
    result = subprocess.run(
        [sys.executable, "-m", "metropolis", "node", *no_seal],
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    assert result.returncode == 2 and "--insecure-seal" in result.stderr
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize("action", ["bootstrap", "run", "register"])
def test_a_root_too_long_for_etcds_socket_is_refused_before_anything_is_written(
    tmp_path: Path, action: str
) -> None:
    # Deep enough that root/ephemeral/consensus/client.sock:0 passes 107 bytes.
    parent = tmp_path / ("d" * max(1, 110 - len(str(tmp_path))))
    parent.mkdir()
    root = parent / "n"
    args = {
        "bootstrap": [*bootstrap_args(tmp_path)],
        "run": ["run", "--root", str(root)],
        "register": [
            *("register", "--root", str(root), "--address", "127.0.0.2"),
            *("--ticket", "00", "--directory", str(tmp_path / "cluster.pb"), "--insecure-seal"),
        ],
    }[action]
    if action == "bootstrap":
        args[args.index("--root") + 1] = str(root)
    result = subprocess.run(
        [sys.executable, "-m", "metropolis", "node", *args],
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert f"--root {root}: too long by " in line and "client.sock:0" in line
    assert list(parent.iterdir()) == []
