"""The owner's side of the cluster: register tickets, approvals, roles, the node table.

Used by ``python -m metropolis owner --root DIR --owner-key FILE ...``
(:mod:`metropolis.__main__`). ``DIR`` is the root of a node of the cluster:
the owner reads the cluster CA and directory from it, and the owner
certificate the bootstrap node left there
(:func:`~metropolis.roleserve.disk.owner_certificate_path`). Every call
goes to the leading curator through :mod:`metropolis.rpc`, which moves to
the leader a follower names.

Errors: :class:`~metropolis.rpc.RPCError` from the curators,
:class:`OwnerError` for local problems (missing files, unknown node).
"""

from __future__ import annotations

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
from metropolis.rpc import Client, client_context, endpoints_from_directory, open_client
from metropolis.rpc import api as methods

__all__ = ["NodeRow", "Owner", "OwnerError", "format_table", "open_owner", "role_names"]


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


class Owner:
    """The owner's calls, on one open client."""

    def __init__(self, client: Client) -> None:
        self.client = client

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
                    )
                )
        return sorted(rows, key=lambda r: r.node_id)

    async def _public_key(self, node: str) -> bytes:
        for row in await self.nodes():
            if row.node_id == node or row.node_id.startswith(node):
                return row.public_key
        raise OwnerError(f"no node {node}")

    async def approve(self, node: str) -> None:
        key = await self._public_key(node)
        await self.client.unary(methods.APPROVE_NODE, m.ApproveNodeRequest(pubkey=key))

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


@asynccontextmanager
async def open_owner(root: Root, owner_key: Ed25519PrivateKey) -> AsyncIterator[Owner]:
    """An :class:`Owner` calling the curators listed in the node root ``root``."""
    try:
        saved = disk.load(root)
        certificate = pki.decode_certificate(disk.owner_certificate_path(root).read_bytes())
    except (OSError, LocalStorageError, pki.PKIError) as e:
        raise OwnerError(f"cannot read the owner's files in {root.path}: {e}") from e
    if saved.credentials is None or saved.directory is None:
        raise OwnerError(f"{root.path} is not a finished node")
    endpoints = endpoints_from_directory(saved.directory, saved.settings.curator_port)
    context = client_context(saved.credentials.ca_certificate, certificate, owner_key)
    async with open_client(endpoints, context) as client:
        yield Owner(client)


def load_owner_key(path: Path) -> Ed25519PrivateKey:
    try:
        return pki.decode_private_key(path.read_bytes())
    except (OSError, pki.PKIError) as e:
        raise OwnerError(f"cannot read the owner key {path}: {e}") from e


def format_table(rows: list[NodeRow]) -> str:
    """The node table: id, address, state, curator (running, or LEADER), roles."""
    lines = [f"{'NODE':<44} {'ADDRESS':<16} {'STATE':<17} {'CURATOR':<8} ROLES"]
    for r in rows:
        curator = "LEADER" if r.leader else ("yes" if r.curator else "-")
        lines.append(
            f"{r.node_id:<44} {r.address or '-':<16} {r.state:<17} "
            f"{curator:<8} {','.join(r.roles) or '-'}"
        )
    return "\n".join(lines)
