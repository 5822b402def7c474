"""The fleet's network: one bridge on the host, one network namespace per machine.

A fleet claims a slot ``N`` (0 to 511) with an exclusive ``flock`` on
``/run/metropolis-machines/slot-N.lock``, held for its whole life (the kernel
lets go when the process ends, however it ends); the slot names its /24 of
198.18.0.0/15 (RFC 2544's benchmarking range, never routed) and its
interfaces, so two fleets on one host never share a name or an address. A
claimed slot's leftovers (bridge, veths, namespaces a killed run left) are
removed first.

* The bridge ``mtbrN`` has the host's address ``198.18.x.1/24``: the
  machines reach the host's servers (agent callback, image server) there.
* Machine ``i`` has a namespace ``mtN-i`` (``/run/netns``, `ip netns`), and
  a veth pair: ``mtNvI`` on the bridge, ``eth0`` inside with a fixed MAC and
  ``198.18.x.(10+i)/24``. The namespace outlives the machine's boots, so a
  reboot keeps its NIC and address, and systemd-nspawn joins it with
  ``--network-namespace-path=`` (the machine cannot change its links).

No route goes beyond the /24: the machines have none but the on-link one
and the bridge has no uplink, so nothing a machine sends leaves the host
(the host forwards nothing to them from elsewhere, having no route to give).

Blocking (runs ``ip``): for a thread. Errors: `NetworkError` with ``ip``'s message.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from shepherd.errors import ShepherdError

__all__ = ["SLOTS", "Link", "Network", "NetworkError", "claim_network"]

logger = logging.getLogger("shepherd.nspawn.network")

_RANGE = ipaddress.IPv4Network("198.18.0.0/15")
#: One /24 per slot.
SLOTS = 512
#: Machines per fleet: addresses .10 to .250 of its /24.
MAX_MACHINES = 240
LOCK_DIR = Path("/run/metropolis-machines")


class NetworkError(ShepherdError):
    """Creating or removing a bridge, veth or namespace failed."""


def _ip(*args: str, check: bool = True) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


@dataclass(frozen=True)
class Link:
    """One machine's place on the network."""

    namespace: str
    #: ``/run/netns/<namespace>``, for ``--network-namespace-path=``.
    namespace_path: Path
    host_veth: str
    mac: str
    address: ipaddress.IPv4Address


class Network:
    """A claimed slot: its bridge and the machines' links. Use `claim_network`."""

    def __init__(self, slot: int, lock: IO[str]) -> None:
        self.slot = slot
        self._lock = lock
        self.subnet = ipaddress.IPv4Network((int(_RANGE.network_address) + slot * 256, 24))
        self.bridge = f"mtbr{slot}"
        self.host_address = self.subnet.network_address + 1
        self.links: dict[int, Link] = {}
        self._closed = False

    @property
    def prefix(self) -> str:
        """Names of this slot's namespaces start with this."""
        return f"mt{self.slot}-"

    def _namespaces(self) -> list[str]:
        found = []
        for line in _ip("netns", "list").splitlines():
            name = line.split()[0] if line.strip() else ""
            if name.startswith(self.prefix):
                found.append(name)
        return found

    def _remove_all(self) -> None:
        for name in self._namespaces():
            # Deleting the namespace deletes its eth0 and so the veth's host end.
            _ip("netns", "delete", name, check=False)
        for link in json.loads(_ip("-j", "link", "show") or "[]"):
            name = link.get("ifname", "")
            if name.startswith(f"mt{self.slot}v"):
                _ip("link", "delete", name, check=False)
        _ip("link", "delete", self.bridge, check=False)

    def _create_bridge(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add(self, index: int) -> Link:
        """Machine ``index``'s namespace and veth (created; kept until `close`)."""
        if not 0 <= index < MAX_MACHINES:
            raise ValueError(f"machine index {index} outside 0..{MAX_MACHINES - 1}")
        if index in self.links:
            return self.links[index]
        namespace = f"{self.prefix}{index}"
        host_veth = f"mt{self.slot}v{index}"
        # Locally administered, unicast; names slot and machine.
        mac = f"02:6d:{self.slot >> 8:02x}:{self.slot & 0xFF:02x}:00:{index:02x}"
        address = self.subnet.network_address + 10 + index
        _ip("netns", "add", namespace)
        try:
            _ip(
                "link", "add", host_veth, "type", "veth",
                "peer", "name", "eth0", "address", mac, "netns", namespace,
            )  # fmt: skip
            _ip("link", "set", host_veth, "master", self.bridge, "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        except NetworkError:
            _ip("netns", "delete", namespace, check=False)
            _ip("link", "delete", host_veth, check=False)
            raise
        link = Link(namespace, Path("/run/netns") / namespace, host_veth, mac, address)
        self.links[index] = link
        return link

    def close(self) -> None:
        """Remove the bridge, every veth and namespace; release the slot. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._remove_all()
        finally:
            self._lock.close()


def claim_network() -> Network:
    """Claim the first free slot, clear its leftovers, create its bridge.

    The locks live in one folder for the whole host (`LOCK_DIR`), never one
    of the caller's: the names they guard (bridge, veths, namespaces) are
    the host's, so a claim through another folder would take a live fleet's
    slot for a dead one and remove its network.

    Raises `NetworkError` when every slot is held or ``ip`` fails (then the
    slot is released again)."""
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    for slot in range(SLOTS):
        lock = (LOCK_DIR / f"slot-{slot}.lock").open("a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        network = Network(slot, lock)
        try:
            network._remove_all()
            network._create_bridge()
        except BaseException:
            network.close()
            raise
        logger.info("network slot %d: bridge %s, %s", slot, network.bridge, network.subnet)
        return network
    raise NetworkError(f"all {SLOTS} network slots are held by other fleets")
