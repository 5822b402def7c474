"""Which etcd client the node code uses, for benchmarks that compare the two.

    python -m bench.controlplane --etcd-client grpc ...
    python -c "from bench.etcdswitch import run_node; run_node()" grpc node run --root ...

``gateway`` leaves :mod:`metropolis.consensus.client` in place;
``grpc`` makes every module that opens an etcd client
(``from metropolis.consensus.client import Client``) open
:class:`bench.etcdgrpc.Client` instead. Both raise the same
errors and return the same records, so nothing else changes.
:func:`run_node` does so and then runs ``python -m metropolis`` with the
rest of its arguments: the node process of ``bench.controlplane``.
"""

from __future__ import annotations

import runpy
import sys

from bench import etcdgrpc as grpcclient
from metropolis.consensus import client as gateway

__all__ = ["CHOICES", "install", "node_command", "run_node"]

CHOICES = ("gateway", "grpc")


def install(name: str) -> str:
    """Make the node code open ``name``'s client; return ``name``.

    Only the node code (``metropolis.*``) switches: modules imported later
    bind the chosen class, those already imported have their ``Client``
    replaced. A benchmark's own etcd client (its baseline's) stays as it was.
    """
    if name not in CHOICES:
        raise ValueError(f"the etcd client is one of {CHOICES}, not {name!r}")
    if name == "grpc":
        original = gateway.Client
        for module in list(sys.modules.values()):
            in_node = module.__name__.startswith("metropolis.")
            if in_node and getattr(module, "Client", None) is original:
                setattr(module, "Client", grpcclient.Client)  # noqa: B010 (any module)
    return name


def node_command(name: str) -> list[str]:
    """The start of a command line that runs ``python -m metropolis`` with ``name``'s client."""
    if name == "gateway":
        return [sys.executable, "-m", "metropolis"]
    return [sys.executable, "-c", "from bench.etcdswitch import run_node; run_node()", name]


def run_node() -> None:
    """``sys.argv[1]`` names the client; the rest are ``python -m metropolis``'s arguments."""
    install(sys.argv[1])
    sys.argv = ["metropolis", *sys.argv[2:]]
    runpy.run_module("metropolis", run_name="__main__", alter_sys=True)
