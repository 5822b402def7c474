"""The fleet's network slots: one per fleet, and a dead run's leftovers cleared."""

from __future__ import annotations

import subprocess
from pathlib import Path

from shepherd.nspawn.network import claim_network
from tests.shepherd.nspawn.fleet_thread import skip_unless_possible
from tests.shepherd.nspawn.netids import link_id


def _exists(link: str) -> bool:
    return Path(f"/sys/class/net/{link}").exists()


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def test_two_fleets_get_two_slots_and_a_dead_runs_leftovers_go() -> None:
    # The host's own lock folder, as every fleet uses: a fleet of another
    # test (another xdist worker) may hold a slot meanwhile, and must keep it.
    skip_unless_possible()
    first = claim_network()
    second = claim_network()
    try:
        assert first.slot != second.slot
        assert not first.subnet.overlaps(second.subnet)
        link = first.add(0)
        kept = second.add(0)
        assert _exists(link.host_veth) and link.namespace in _namespaces()
        # A run killed without cleaning up: its lock goes with the process,
        # its bridge, veth and namespace stay.
        first._lock.close()
        again = claim_network()
        try:
            assert again.slot == first.slot
            assert not _exists(link.host_veth)
            assert link.namespace not in _namespaces()
            assert _exists(again.bridge)
            # The live fleet's network was not touched by either claim.
            assert _exists(kept.host_veth) and kept.namespace in _namespaces()
            assert _exists(second.bridge)
        finally:
            again_bridge = link_id(again.bridge)
            again.close()
        # By identity: another run may claim the freed slot, and its names.
        assert link_id(again.bridge) != again_bridge
    finally:
        first._closed = True  # its slot was taken over and removed above
        second_bridge = link_id(second.bridge)
        second.close()
    assert link_id(second.bridge) != second_bridge
