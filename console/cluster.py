"""The web UI's cluster pages: nodes, one node, a node's supervision tree.

They show the cluster as its owner sees it, through
:mod:`metropolis.owner` with the owner's files (``python -m console web
--cluster-owner-root DIR --cluster-owner-key FILE``, the ``--root`` and
``--owner-key`` of ``python -m metropolis owner``), read once at start::

    /cluster                 GetNodes at the leading curator        (1 call)
    /cluster/node/ID         GetNodes                               (1 call)
    /cluster/node/ID/tree    GetNodes, then the node's own
                             NodeDebug.GetSupervisionTree           (2 calls)

The node list and a node's page also name the machine each node was
installed on, linked to its page: the BMDB machine whose current install
report carries the node's public key (`bmdb.overview.machines_of_nodes`,
one statement). When the BMDB does not answer, the pages say so in that
place and show the rest.

Each page connects anew, so curators that come and go are followed. When
a curator or the node does not answer, the page says which addresses were
tried and what the error was, as a normal page (HTTP 200 with the
navigation): the cluster being down is what the operator came to see, not
a fault of the UI. Nothing secret is shown: no keys, no join data, no
certificates; node IDs, addresses, states, role names and one-line errors.
Every text is escaped by the templates (:mod:`console.render`).
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from bmdb import overview
from bmdb.connection import Connection
from bmdb.errors import BMDBError
from console.errors import ConsoleError, NotFound
from console.render import Page
from metropolis.errors import MetropolisError
from metropolis.owner import NodeRow, Owner, OwnerAccess
from metropolis.proto import management as m

__all__ = ["CALL_TIMEOUT", "ClusterView", "disabled"]

#: Seconds a page waits for the cluster's answers before it explains the silence.
CALL_TIMEOUT = 10.0

T = TypeVar("T")


class _Unreachable(ConsoleError):
    """The curators or the node did not answer; the page explains."""

    def __init__(self, what: str, addresses: list[str], error: str) -> None:
        super().__init__(error)
        self.what = what
        self.addresses = addresses
        self.error = error


def disabled() -> Page:
    """The cluster link's page when the UI was started without owner credentials."""
    return Page("cluster_disabled.html", "Cluster")


class ClusterView:
    """The cluster pages of one cluster, called by the ASGI app per request."""

    def __init__(self, access: OwnerAccess) -> None:
        self._access = access

    def curators(self) -> list[str]:
        """The curator addresses the pages call (from the owner's node root)."""
        return [e.address for e in self._access.endpoints]

    async def _ask(self, call: Callable[[Owner], Awaitable[T]]) -> T:
        """``call`` on a new owner client; :class:`_Unreachable` if the curators fail."""
        try:
            with trio.fail_after(CALL_TIMEOUT):
                async with self._access.open() as owner:
                    return await call(owner)
        except trio.TooSlowError:
            error = f"no answer within {CALL_TIMEOUT:g} s"
        except MetropolisError as e:
            error = str(e)
        raise _Unreachable("the cluster's curators", self.curators(), error)

    async def _row(self, owner: Owner, node_id: str) -> NodeRow:
        for row in await owner.nodes():
            if row.node_id == node_id:
                return row
        raise NotFound(f"no node {node_id} in the cluster")

    async def nodes(self, conn: Connection) -> Page:
        """Every node: address, state, roles, curator and leader, health,
        and the machine it was installed on (from the BMDB ``conn``)."""
        try:
            rows = await self._ask(lambda owner: owner.nodes())
        except _Unreachable as e:
            return _unreachable_page("Cluster nodes", e)
        return Page(
            "cluster_nodes.html",
            "Cluster nodes",
            {"curators": self.curators(), "rows": rows, "machines": await _machines(conn, rows)},
            footer=f"{len(rows)} nodes",
        )

    async def node(self, conn: Connection, node_id: str) -> Page:
        """One node: everything the curators know of it, the machine it was
        installed on (from the BMDB ``conn``), and a link to its tree."""
        try:
            row = await self._ask(lambda owner: self._row(owner, node_id))
        except _Unreachable as e:
            return _unreachable_page(f"Node {node_id}", e)
        return Page(
            "cluster_node.html",
            f"Node {row.node_id}",
            {"row": row, "machines": await _machines(conn, [row])},
        )

    async def tree(self, node_id: str) -> Page:
        """The node's supervision tree, asked of the node itself."""
        title = f"Supervision tree of {node_id}"
        try:
            row = await self._ask(lambda owner: self._row(owner, node_id))
        except _Unreachable as e:
            return _unreachable_page(title, e)
        address = f"{row.address}:{row.debug_port}"
        try:
            with trio.fail_after(CALL_TIMEOUT):
                async with self._access.open() as owner:
                    answer = await owner.supervision_tree(row)
        except trio.TooSlowError:
            error = f"no answer within {CALL_TIMEOUT:g} s"
        except MetropolisError as e:
            error = str(e)
        else:
            return _tree_page(title, address, answer)
        return _unreachable_page(title, _Unreachable("the node's debug service", [address], error))


#: The machines of nodes by public key, or why the BMDB could not say.
_Machines = dict[bytes, tuple[uuid.UUID, ...]] | str


async def _machines(conn: Connection, rows: list[NodeRow]) -> _Machines:
    try:
        found = await overview.machines_of_nodes(conn, [r.public_key for r in rows])
    except BMDBError as e:
        return f"BMDB: {e}"
    return found


def _unreachable_page(title: str, e: _Unreachable) -> Page:
    return Page(
        "cluster_unreachable.html", title, {"what": e.what, "tried": e.addresses, "error": e.error}
    )


def _tree_page(title: str, address: str, answer: m.GetSupervisionTreeResponse) -> Page:
    return Page(
        "cluster_tree.html",
        title,
        {
            "node_id": answer.node_id,
            "address": address,
            "runnables": [(r, *_state(r.state)) for r in answer.runnables],
            "now": datetime.datetime.now(datetime.UTC),
        },
        footer=f"{len(answer.runnables)} runnables",
    )


def _state(state: m.SupervisedRunnableState) -> tuple[str, str]:
    """A runnable's state: its name and the CSS class it is shown with."""
    name = m.SupervisedRunnableState(state).name or "UNKNOWN"
    css = "state-failed" if state == m.SupervisedRunnableState.BACKOFF else f"state-{name.lower()}"
    return name, css
