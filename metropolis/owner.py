"""The owner's side of the cluster: register tickets, approvals, roles, the node table,
a node's supervision tree.

Used by ``python -m metropolis owner --root DIR --owner-key FILE ...``
(:mod:`metropolis.__main__`). ``DIR`` is the root of a node of the cluster:
the owner reads the cluster CA and directory from it, and the owner
certificate the bootstrap node left there
(:func:`~metropolis.roleserve.disk.owner_certificate_path`). Every call
goes to the leading curator through :mod:`metropolis.rpc`, which moves to
the leader a follower names.

The root is checked as every entry point checks it
(:meth:`~metropolis.localstorage.Root.check`, through
:func:`~metropolis.roleserve.disk.load`), and refused, not merely warned
about, if another user could have changed it: the CA certificate read
there decides whom the owner's key authenticates to, so a swapped one
would hand the owner's calls (approvals, tickets) to someone else.

Errors: :class:`~metropolis.rpc.RPCError` from the curators,
:class:`OwnerError` for local problems (missing files, unknown node).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from metropolis import identity, pki
from metropolis.errors import MetropolisError
from metropolis.localstorage import LocalStorageError, Root
from metropolis.proto import management as m
from metropolis.proto.common import NodeState
from metropolis.roleserve import disk
from metropolis.roleserve.values import role_names
from metropolis.rpc import (
    Client,
    Endpoint,
    client_context,
    endpoints_from_directory,
    methods,
    open_client,
)

__all__ = [
    "NodeRow",
    "Owner",
    "OwnerAccess",
    "OwnerError",
    "format_age",
    "format_table",
    "format_tree",
    "load_owner",
    "open_owner",
    "role_names",
]


class OwnerError(MetropolisError):
    """The owner's files are missing or a node named on the command line is unknown."""


@dataclass(frozen=True)
class NodeRow:
    """One line of the node table."""

    node_id: str
    public_key: bytes
    address: str
    state: str
    roles: tuple[str, ...]
    curator: bool
    #: The curator that answered (the client only settles on the leader).
    leader: bool = False
    #: Where the node serves its debug service (0: it reported none).
    debug_port: int = 0
    #: The curator's view of the node's health (``NodeHealth`` name).
    health: str = "UNKNOWN"
    #: Seconds since the node's last heartbeat, if the curator knows.
    since_heartbeat: float | None = None


class Owner:
    """The owner's calls, on one open client to the curators.

    ``context`` (the owner's TLS identity) is used again to call a node's
    own debug service (:meth:`supervision_tree`).
    """

    def __init__(self, client: Client, context: ssl.SSLContext) -> None:
        self.client = client
        self._context = context

    async def nodes(self) -> list[NodeRow]:
        async with self.client.stream(methods.GET_NODES, m.GetNodesRequest()) as call:
            rows = []
            async for node in call:
                status = node.status
                address = status.external_address if status else ""
                rows.append(
                    NodeRow(
                        node_id=identity.node_id(node.pubkey),
                        public_key=node.pubkey,
                        address=address,
                        state=NodeState(node.state).name,
                        roles=role_names(node.roles),
                        curator=bool(status and status.running_curator),
                        leader=bool(address) and address == self.client.endpoint.host,
                        debug_port=status.debug_port if status else 0,
                        health=m.NodeHealth(node.health).name,
                        since_heartbeat=(
                            node.time_since_heartbeat.total_seconds()
                            if node.time_since_heartbeat is not None
                            else None
                        ),
                    )
                )
        return sorted(rows, key=lambda r: r.node_id)

    async def row(self, node: str) -> NodeRow:
        """The node ``node`` (its ID or a unique prefix of it).

        :class:`OwnerError` if no node matches, or if the prefix matches
        more than one: every ID starts with ``metropolis-``, and a call that
        approves or changes roles must not pick one of several nodes.
        """
        rows = await self.nodes()
        for row in rows:
            if row.node_id == node:
                return row
        matches = [row for row in rows if row.node_id.startswith(node)]
        if not matches:
            raise OwnerError(f"no node {node}")
        if len(matches) > 1:
            raise OwnerError(f"{node!r} names {len(matches)} nodes; give more of the ID")
        return matches[0]

    async def _public_key(self, node: str) -> bytes:
        return (await self.row(node)).public_key

    async def approve(self, node: str) -> NodeRow:
        """Approve the NEW node ``node`` (ID or unique prefix); its row as it was.

        :class:`OwnerError` if it is not NEW (see :meth:`approve_row`).
        """
        row = await self.row(node)
        await self.approve_row(row)
        return row

    async def approve_row(self, row: NodeRow) -> None:
        """Approve the node of ``row`` (NEW -> STANDBY); it then commits and joins.

        :class:`OwnerError` if ``row`` is not NEW: the curator would take
        a second approval of a STANDBY or UP node as a no-op, and a caller
        that thinks it admitted a node must learn that it did not.
        """
        if row.state != "NEW":
            raise OwnerError(f"{row.node_id} is {row.state}, not NEW: nothing to approve")
        await self.client.unary(methods.APPROVE_NODE, m.ApproveNodeRequest(pubkey=row.public_key))

    async def set_roles(
        self,
        node: str,
        *,
        consensus_member: bool | None = None,
        kubernetes_controller: bool | None = None,
    ) -> None:
        key = await self._public_key(node)
        await self.client.unary(
            methods.UPDATE_NODE_ROLES,
            m.UpdateNodeRolesRequest(
                pubkey=key,
                consensus_member=consensus_member,
                kubernetes_controller=kubernetes_controller,
            ),
        )

    async def ticket(self) -> bytes:
        response = await self.client.unary(
            methods.GET_REGISTER_TICKET, m.GetRegisterTicketRequest()
        )
        return response.ticket

    async def info(self) -> m.GetClusterInfoResponse:
        return await self.client.unary(methods.GET_CLUSTER_INFO, m.GetClusterInfoRequest())

    async def supervision_tree(self, row: NodeRow) -> m.GetSupervisionTreeResponse:
        """The supervision tree of the node ``row``, from the node itself.

        Calls the node's debug service at its reported address and debug
        port, and believes only a server holding that node's key.
        :class:`OwnerError` if the node reported no address or debug port;
        :class:`~metropolis.rpc.RPCError` (UNAVAILABLE) if it does not answer.
        """
        if not row.address or not row.debug_port:
            raise OwnerError(f"{row.node_id} has not reported its debug service")
        endpoint = Endpoint(row.address, row.debug_port, row.public_key)
        async with open_client([endpoint], self._context) as client:
            return await client.unary(methods.GET_SUPERVISION_TREE, m.GetSupervisionTreeRequest())


@dataclass(frozen=True)
class OwnerAccess:
    """What the owner needs to call a cluster: its curators and the owner's TLS identity.

    Read once (:func:`load_owner`); each :meth:`open` connects anew, so a
    long-running program (the web UI) follows curators that come and go.
    """

    endpoints: list[Endpoint]
    context: ssl.SSLContext

    @asynccontextmanager
    async def open(self) -> AsyncIterator[Owner]:
        """An :class:`Owner` on a new client; nothing is connected until its first call."""
        async with open_client(self.endpoints, self.context) as client:
            yield Owner(client, self.context)


def load_owner(root: Root, owner_key: Ed25519PrivateKey) -> OwnerAccess:
    """The owner's access through the node root ``root``; :class:`OwnerError` if unusable."""
    try:
        saved = disk.load(root)
        certificate = pki.decode_certificate(disk.owner_certificate_path(root).read_bytes())
    except (OSError, LocalStorageError, pki.PKIError) as e:
        raise OwnerError(f"cannot read the owner's files in {root.path}: {e}") from e
    if saved.credentials is None or saved.directory is None:
        raise OwnerError(f"{root.path} is not a finished node")
    endpoints = endpoints_from_directory(saved.directory, saved.settings.curator_port)
    context = client_context(saved.credentials.ca_certificate, certificate, owner_key)
    return OwnerAccess(endpoints, context)


@asynccontextmanager
async def open_owner(root: Root, owner_key: Ed25519PrivateKey) -> AsyncIterator[Owner]:
    """An :class:`Owner` calling the curators listed in the node root ``root``."""
    async with load_owner(root, owner_key).open() as owner:
        yield owner


def load_owner_key(path: Path) -> Ed25519PrivateKey:
    try:
        return pki.decode_private_key(path.read_bytes())
    except (OSError, pki.PKIError) as e:
        raise OwnerError(f"cannot read the owner key {path}: {e}") from e


def format_tree(tree: m.GetSupervisionTreeResponse) -> str:
    """A node's supervision tree: dotted name, state, restarts, last error."""
    lines = [f"{'RUNNABLE':<48} {'STATE':<9} {'RESTARTS':>8}  LAST ERROR"]
    for r in tree.runnables:
        state = m.SupervisedRunnableState(r.state).name
        lines.append(f"{r.name:<48} {state:<9} {r.restarts:>8}  {r.last_error or '-'}")
    return "\n".join(lines)


def format_age(seconds: float | None) -> str:
    """``3s ago``, ``4m ago``, ``2h ago``; ``-`` for never."""
    if seconds is None:
        return "-"
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{int(seconds)}s ago"


def format_table(rows: list[NodeRow]) -> str:
    """The node table: id, address, state, health, last heartbeat, curator (or LEADER), roles."""
    lines = [
        f"{'NODE':<44} {'ADDRESS':<16} {'STATE':<17} {'HEALTH':<17} {'LAST HEARTBEAT':<14} "
        f"{'CURATOR':<8} ROLES"
    ]
    for r in rows:
        curator = "LEADER" if r.leader else ("yes" if r.curator else "-")
        lines.append(
            f"{r.node_id:<44} {r.address or '-':<16} {r.state:<17} {r.health:<17} "
            f"{format_age(r.since_heartbeat):<14} {curator:<8} {','.join(r.roles) or '-'}"
        )
    return "\n".join(lines)
