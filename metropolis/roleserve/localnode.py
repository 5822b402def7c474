"""A node root ready to bootstrap on loopback, for tests, benchmarks and demos.

What ``python -m metropolis node bootstrap`` saves before it starts
anything, with free loopback peer and curator ports (never the fixed
defaults: another node on this machine, a test running beside this one,
may hold them) and etcd's loopback tuning, so a
test or benchmark can start a :class:`~metropolis.roleserve.node.RoleServer`
on it in-process.
"""

from __future__ import annotations

from metropolis import pki
from metropolis.consensus.localetcd import LOOPBACK_TUNING
from metropolis.localstorage import Root
from metropolis.roleserve import disk
from metropolis.roleserve.values import BootstrapData
from monotrio.net import free_loopback_port

__all__ = ["prepare_loopback_bootstrap"]


def prepare_loopback_bootstrap(root: Root) -> BootstrapData:
    """Save settings and a bootstrap intent in ``root`` (a new owner key); return the data."""
    data = BootstrapData.generate(pki.public_key_bytes(pki.generate_key()))
    settings = disk.NodeSettings(
        address="127.0.0.1",
        peer_port=free_loopback_port(),
        curator_port=free_loopback_port(),
        debug_port=free_loopback_port(),
        tuning=LOOPBACK_TUNING,
        insecure_seal=True,
    )
    disk.save_settings_and_intent(root, settings, data)
    return data
