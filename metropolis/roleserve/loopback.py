"""A node root ready to bootstrap on loopback, for tests, benchmarks and demos.

What ``python -m metropolis node bootstrap`` saves before it starts
anything, with free loopback peer and curator ports (never the fixed
defaults: another node on this machine, a test running beside this one,
may hold them) and etcd's loopback tuning, so a test or benchmark can
start a :class:`~metropolis.roleserve.server.RoleServer` on it in-process.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.net import free_loopback_port
from metropolis import pki
from metropolis.consensus.localetcd import LOOPBACK_TUNING
from metropolis.localstorage import Root
from metropolis.roleserve import disk
from metropolis.roleserve.values import BootstrapData

__all__ = ["loopback_settings", "prepare_loopback_bootstrap"]


def loopback_settings(
    address: str = "127.0.0.1", *, peer_port: int | None = None, curator_port: int | None = None
) -> disk.NodeSettings:
    """Settings for a node at ``address``; ports left out are free ones.

    Nodes of one cluster share their peer and curator ports (each has its
    own address, as Monogon's do): pass the first node's to the others.
    Each gets its own free debug port.
    """
    return disk.NodeSettings(
        address=address,
        peer_port=peer_port if peer_port is not None else free_loopback_port(),
        curator_port=curator_port if curator_port is not None else free_loopback_port(),
        debug_port=free_loopback_port(),
        tuning=LOOPBACK_TUNING,
        insecure_seal=True,
    )


def prepare_loopback_bootstrap(
    root: Root,
    *,
    owner_key: Ed25519PrivateKey | None = None,
    settings: disk.NodeSettings | None = None,
) -> BootstrapData:
    """Save settings and a bootstrap intent in ``root``; return the data.

    ``owner_key``: the initial owner's key (a new one, thrown away, if
    None); ``settings``: :func:`loopback_settings` if None.
    """
    owner = owner_key if owner_key is not None else pki.generate_key()
    data = BootstrapData.generate(pki.public_key_bytes(owner))
    disk.save_settings_and_intent(root, settings or loopback_settings(), data)
    return data
