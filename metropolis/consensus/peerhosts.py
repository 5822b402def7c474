"""The hosts a member's peer certificate names for its peer address (:func:`peer_hosts`).

Standard library only: ``node recover`` checks the node's certificate
against them before etcd's client is imported.
"""

from __future__ import annotations

import ipaddress

__all__ = ["peer_hosts"]


def peer_hosts(peer_address: str) -> list[str]:
    """The host of a ``host:port`` peer address, as a certificate SAN wants it.

    ``[::1]:7834`` gives ``::1`` (an IP SAN, not a DNS name ``[::1]``).
    An IPv4 loopback address other than 127.0.0.1 gives 127.0.0.1 too:
    etcd checks a peer's client certificate against the address the
    connection comes from, and Linux sends every connection between IPv4
    loopback addresses from 127.0.0.1 (the source of lo's local route), so
    without it no other member accepts this one's connections (as
    `metropolis.consensus.membership` does for the members it adds). It
    grants nothing beyond this host.
    """
    host = peer_address.rsplit(":", 1)[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return [host]
    if address.version == 4 and address.is_loopback and host != "127.0.0.1":
        return [host, "127.0.0.1"]
    return [host]
