"""A node's curator lease TTL and heartbeat timeout are the node's settings.

Saved with the node's other settings (older roots without them get the
defaults); an in-process bootstrap node campaigns on a lease of its TTL
(the early lease of the bootstrap included) and times nodes out after its
heartbeat timeout.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

import metropolis.__main__ as cli
from metropolis import pki
from metropolis.cli.node import node_settings
from metropolis.consensus.client import Client
from metropolis.consensus.process import SOCKET_NAME, Tuning
from metropolis.curator.election import DEFAULT_TTL, Leader
from metropolis.curator.state import LEADER_KEY
from metropolis.localstorage import Root, read_checked, write_checked
from metropolis.owner import open_owner
from metropolis.proto.curator import LeaderElectionValue
from metropolis.roleserve import disk
from metropolis.roleserve.loopback import loopback_settings, prepare_loopback_bootstrap
from metropolis.roleserve.server import RoleServer
from metropolis.roleserve.values import ClusterMembership
from metropolis.rpc import RPCError
from metropolis.supervisor import open_supervisor

BOUND = 90


def test_the_settings_are_saved_and_older_roots_get_the_defaults(tmp_path: Path) -> None:
    root = Root(tmp_path / "n")
    settings = dataclasses.replace(loopback_settings(), curator_lease_ttl=3, heartbeat_timeout=0.5)
    prepare_loopback_bootstrap(root, settings=settings)
    loaded = disk.load(root).settings
    assert loaded == settings and loaded.curator_heartbeat_timeout == 0.5

    # A root saved before these settings existed.
    path = disk.settings_path(root)
    raw = json.loads(read_checked(path, "settings", advice=""))
    del raw["curator_lease_ttl_s"], raw["heartbeat_timeout_s"]
    write_checked(path, "settings", json.dumps(raw).encode())
    older = disk.load(root).settings
    assert older.curator_lease_ttl == DEFAULT_TTL and older.heartbeat_timeout is None
    assert older.curator_heartbeat_timeout == 2 * older.status_interval


@pytest.mark.parametrize(
    "change", [{"curator_lease_ttl": 0}, {"heartbeat_timeout": 0.0}, {"heartbeat_timeout": -1.0}]
)
def test_settings_refuse_a_lease_or_timeout_that_cannot_work(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(loopback_settings(), **change)


def _local(m: ClusterMembership) -> bool:
    return m.home and m.local_consensus is not None and m.local_curator is not None


async def test_the_curator_campaigns_and_times_out_as_the_node_is_set(tmp_path: Path) -> None:
    root = Root(tmp_path / "n")
    owner_key = pki.generate_key()
    # Pushes every 5 s (the default), timed out after 0.5 s: the node
    # itself goes HEARTBEAT_TIMEOUT between two pushes.
    settings = dataclasses.replace(loopback_settings(), curator_lease_ttl=3, heartbeat_timeout=0.5)
    prepare_loopback_bootstrap(root, owner_key=owner_key, settings=settings)
    server = RoleServer(root, disk.load(root), fetch_roles=False)
    async with open_supervisor(server.run, name="role"):
        with trio.fail_after(BOUND):
            with server.membership.watch() as w:
                membership = await w.get(_local)
            assert membership.local_curator is not None
            with membership.local_curator.election.watch() as e:
                leader = await e.get(lambda s: isinstance(s, Leader))
            assert isinstance(leader, Leader)
            async with Client(root.ephemeral.consensus / SOCKET_NAME) as etcd:
                stored = await etcd.get(b"namespaced/curator/" + LEADER_KEY)
                assert stored is not None
                assert LeaderElectionValue.parse(stored.value).ttl == 3
                # The lease the campaign holds (the bootstrap's early one).
                assert await etcd.keep_alive_once(leader.lease_id) == 3

            async with open_owner(root, owner_key) as owner:
                # Heard (HEALTHY after each push), and timed out while the
                # node runs on (before its next push).
                seen: set[str] = set()
                while not {"HEALTHY", "HEARTBEAT_TIMEOUT"} <= seen:
                    try:
                        [row] = await owner.nodes()
                    except RPCError:  # the curator's first answers may precede its lead
                        await trio.sleep(0.1)
                        continue
                    seen.add(row.health)
                    await trio.sleep(0.1)


def test_the_lease_ttl_flag_is_checked_in_one_line(tmp_path: Path) -> None:
    """``--curator-lease-ttl`` reaches NodeSettings, whose refusal is one line."""
    result = subprocess.run(
        [
            sys.executable, "-m", "metropolis", "node", "bootstrap",
            "--root", str(tmp_path / "node"), "--address", "127.0.0.9", "--insecure-seal",
            "--owner-key-out", str(tmp_path / "owner.pem"), "--curator-lease-ttl", "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "curator lease TTL must be >= 1 s" in lines[0], result.stderr
    assert not (tmp_path / "node").exists()


@pytest.mark.parametrize(("flag", "wait"), [((), True), (("--member-health-wait", "off"), False)])
@pytest.mark.parametrize("action", ["bootstrap", "register"])
def test_the_member_health_wait_flag_reaches_the_tuning(
    action: str, flag: tuple[str, ...], wait: bool
) -> None:
    """``--member-health-wait off`` (tests on one machine) reaches the tuning; on by default."""
    common = ["--root", "r", "--address", "127.0.0.9", "--insecure-seal", "--raft-tuning", "20,200"]
    own = ["--owner-key-out", "o.pem"] if action == "bootstrap" else ["--ticket", "00"]
    args = cli._parser().parse_args(["node", action, *common, *own, *flag])
    settings = node_settings(args)
    # Saved with the settings: test_roleserve.py's saved-setting test.
    assert settings.tuning == Tuning(20, 200, member_health_wait=wait)


def test_the_parser_s_register_deadline_is_register_s_default() -> None:
    """The parser writes the default down (it imports no node module): the same number."""
    from metropolis.roleserve.register import DEFAULT_DEADLINE

    args = cli._parser().parse_args(["node", "run", "--root", "r"])
    assert args.register_deadline == cli.REGISTER_DEADLINE == DEFAULT_DEADLINE
