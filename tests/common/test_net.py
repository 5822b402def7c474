"""`common.net.free_loopback_port`: a port that outgoing connections cannot
take before its server binds it."""

from __future__ import annotations

import socket
from pathlib import Path

from common.net import free_loopback_port


def _ephemeral_start() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_ports_lie_below_the_ephemeral_range_and_can_be_bound() -> None:
    start = _ephemeral_start()
    ports = [free_loopback_port() for _ in range(50)]
    assert all(1024 <= p < start for p in ports), ports
    assert len(set(ports)) > 40  # random, not one port again and again
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()


def test_a_port_in_use_is_not_returned() -> None:
    held = []
    try:
        # Hold a good share of the candidates; none of them may come back.
        for _ in range(300):
            s = socket.socket()
            s.bind(("127.0.0.1", free_loopback_port()))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        for _ in range(200):
            assert free_loopback_port() not in taken
    finally:
        for s in held:
            s.close()
