"""The fleet's network slots: one per fleet, and a dead run's leftovers cleared."""

from __future__ import annotations

import subprocess
from pathlib import Path

from shepherd.nspawn.network import claim_network
from tests.shepherd.nspawn.fleet_thread import skip_unless_possible


def _exists(link: str) -> bool:
    return Path(f"/sys/class/net/{link}").exists()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_two_fleets_get_two_slots_and_a_dead_runs_leftovers_go(tmp_path: Path) -> None:
    skip_unless_possible()
    first = claim_network(tmp_path)
    second = claim_network(tmp_path)
    try:
        assert first.slot != second.slot
        assert not first.subnet.overlaps(second.subnet)
        link = first.add(0)
        assert _exists(link.host_veth) and link.namespace in _namespaces()
        # A run killed without cleaning up: its lock goes with the process,
        # its bridge, veth and namespace stay.
        first._lock.close()
        again = claim_network(tmp_path)
        try:
            assert again.slot == first.slot
            assert not _exists(link.host_veth)
            assert link.namespace not in _namespaces().split()
            assert _exists(again.bridge)
        finally:
            again.close()
        assert not _exists(again.bridge)
    finally:
        first._closed = True  # its slot was taken over and removed above
        second.close()
    assert not _exists(second.bridge)
