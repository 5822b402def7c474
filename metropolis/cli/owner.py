"""``metropolis owner ...``: the owner's calls, from parsed arguments.

Imported by :mod:`metropolis.__main__` only for an ``owner`` command: it
brings the RPC client, TLS and the owner's keys, none of a node's servers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from common.durable import atomic_write
from metropolis import identity
from metropolis.cli.root import checked_root
from metropolis.errors import MetropolisError
from metropolis.owner import (
    Change,
    Owner,
    OwnerAccess,
    describe_change,
    format_table,
    format_tree,
    load_owner,
    load_owner_from_cluster,
    load_owner_key,
)

__all__ = ["Say", "call", "owner_access", "run", "saying_waits"]


def _onoff(value: str | None) -> bool | None:
    return None if value is None else value == "on"


#: What a call that takes a while is waiting for, said after :data:`_PATIENCE` seconds.
_WAITS = {
    "consensus-on": (
        "waiting for the curator to add the node to etcd (etcd admits a new member "
        "only once its leader is connected to every peer; this can take a while)"
    ),
    "consensus-off": "waiting for the curator to remove the node's etcd member",
    "delete": "waiting for the curator to remove the node's etcd member and revoke it",
    "any": "still waiting for the curators (a leader may be being elected)",
}
_PATIENCE = 1.0


#: Where a command's text goes: stdout or stderr of this process, or of
#: the process whose call an owner session runs.
Say = Callable[[str], None]


def _stdout(text: str) -> None:
    sys.stdout.write(text)


def _stderr(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


@asynccontextmanager
async def saying_waits(what: str, say: Say = _stderr) -> AsyncIterator[None]:
    """Run the block; if it takes over :data:`_PATIENCE` s, ``say`` (stderr
    by default) what it waits for."""
    async with trio.open_nursery() as nursery:

        async def tell() -> None:
            await trio.sleep(_PATIENCE)
            say(_WAITS[what] + "...\n")

        nursery.start_soon(tell)
        try:
            yield
        finally:
            nursery.cancel_scope.cancel()


def owner_access(args: argparse.Namespace) -> OwnerAccess:
    """The owner's access that ``args`` name (``--cluster`` or ``--root``,
    ``--owner-key``), read from their files now.

    Errors: :class:`~metropolis.errors.MetropolisError` naming the file.
    """
    key = load_owner_key(args.owner_key)
    if args.cluster is not None:
        return load_owner_from_cluster(args.cluster, key, args.curator_port)
    return load_owner(checked_root(args.root), key)


async def run(args: argparse.Namespace) -> None:
    """Make the owner call of ``args``; what it says goes to stdout.

    Errors: :class:`~metropolis.errors.MetropolisError` (the curators'
    :class:`~metropolis.rpc.RPCError` included), one line for the operator.
    """
    access = owner_access(args)
    async with saying_waits("any"):
        await access.tls_context()  # the escrow, unless the root keeps a certificate
    async with access.open() as owner:
        await call(args, owner, _stdout, _stderr)


async def call(args: argparse.Namespace, owner: Owner, out: Say, err: Say) -> None:
    """Make the owner call of ``args`` on ``owner``: what it says goes to
    ``out``, what it waits for to ``err``.

    Errors: as :func:`run`'s. Cancellation: cancels the call (a change the
    curators already made stays made).
    """
    if args.action == "nodes":
        async with saying_waits("any", err):
            rows = await owner.nodes()
        out(format_table(rows) + "\n")
    elif args.action == "approve":
        async with saying_waits("any", err):
            row = await owner.approve(args.node)
            after = await owner.current(row)
        # A NEW node has pushed no status yet, so usually no address.
        address = row.address or "none reported yet"
        out(f"approved {row.node_id} (address {address})\n")
        if after is not None:
            out(describe_change(Change(row, after)) + "\n")
    elif args.action == "set-roles":
        consensus = _onoff(args.consensus_member)
        what = "any" if consensus is None else ("consensus-on" if consensus else "consensus-off")
        async with saying_waits(what, err):
            change = await owner.set_roles(
                args.node,
                consensus_member=consensus,
                kubernetes_controller=_onoff(args.kubernetes_controller),
            )
        out(describe_change(change) + "\n")
    elif args.action == "delete":
        async with saying_waits("delete", err):
            change = await owner.delete(args.node, force=args.force)
        out(describe_change(change) + "\n")
    elif args.action == "tree":
        tree = await owner.supervision_tree(await owner.row(args.node))
        out(format_tree(tree) + "\n")
    elif args.action == "ticket":
        out((await owner.ticket()).hex() + "\n")
    elif args.action == "snapshot":
        if args.root is None:
            raise MetropolisError("snapshot needs --root: the node whose etcd member it reads")
        # The owner key must be the cluster's: the curators answer it.
        await owner.info()
        # Imported here, as for recoveries: etcd's client only for them.
        from metropolis.cli.member import snapshot

        out(await snapshot(checked_root(args.root), args.out) + "\n")
    elif args.action == "recoveries":
        if args.root is None:
            raise MetropolisError("recoveries needs --root: the node whose etcd member it reads")
        await owner.info()
        from metropolis.cli.member import recoveries

        out(await recoveries(checked_root(args.root)) + "\n")
    else:
        info = await owner.info()
        if args.out is not None:
            atomic_write(args.out.resolve(), bytes(info))
        directory = info.cluster_directory
        for node in directory.nodes if directory else []:
            hosts = ",".join(a.host for a in node.addresses)
            out(f"{identity.node_id(node.public_key)} {hosts}\n")
