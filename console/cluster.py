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
Every text is escaped by :mod:`console.render`.
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
from console.render import Html, ago, duration, esc, fields, link, page, table
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


def disabled() -> Html:
    """The cluster link's page when the UI was started without owner credentials."""
    return page(
        "Cluster",
        Html(
            "<p>The cluster views are off: this UI was started without the "
            "cluster owner's credentials. Start it with "
            "<code>python -m console web --cluster-owner-root DIR "
            "--cluster-owner-key FILE</code>, where DIR and FILE are what "
            "<code>python -m metropolis owner --root DIR --owner-key FILE</code> "
            "takes: a cluster node's root (with the owner certificate) and the "
            "owner's private key.</p>"
        ),
    )


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

    async def nodes(self, conn: Connection) -> Html:
        """Every node: address, state, roles, curator and leader, health,
        and the machine it was installed on (from the BMDB ``conn``)."""
        try:
            rows = await self._ask(lambda owner: owner.nodes())
        except _Unreachable as e:
            return _unreachable_page("Cluster nodes", e)
        machines = await _machines(conn, rows)
        body = table(
            _NODE_COLUMNS,
            (
                (
                    link(f"/cluster/node/{r.node_id}", r.node_id, **{"class": "mono"}),
                    _machine_cell(machines, r),
                    r.address or "-",
                    r.state,
                    ", ".join(r.roles) or "-",
                    _curator(r),
                    r.health,
                    _since(r.since_heartbeat),
                    _image(r),
                    r.slot_state,
                    link(f"/cluster/node/{r.node_id}/tree", "supervision tree")
                    if r.debug_port
                    else "-",
                )
                for r in rows
            ),
            empty="no nodes",
        )
        intro = Html(f"<p>As the owner sees it, through the curators at {_addresses(self)}.</p>")
        return page("Cluster nodes", Html(intro + body), footer=f"{len(rows)} nodes")

    async def node(self, conn: Connection, node_id: str) -> Html:
        """One node: everything the curators know of it, the machine it was
        installed on (from the BMDB ``conn``), and a link to its tree."""
        try:
            row = await self._ask(lambda owner: self._row(owner, node_id))
        except _Unreachable as e:
            return _unreachable_page(f"Node {node_id}", e)
        machines = await _machines(conn, [row])
        debug = f"{row.address}:{row.debug_port}" if row.debug_port else "-"
        body = fields(
            [
                ("node", row.node_id),
                ("machine", _machine_cell(machines, row)),
                ("address", row.address or "-"),
                ("state", row.state),
                ("roles", ", ".join(row.roles) or "-"),
                ("curator", _curator(row)),
                ("health", row.health),
                ("heartbeat", _since(row.since_heartbeat)),
                ("image", Html(f'<span class="mono">{esc(row.image or "-")}</span>')),
                ("slot", _slot_text(row)),
                ("went back from", _rollback(row)),
                ("debug service", debug),
            ]
        )
        tree = (
            link(f"/cluster/node/{row.node_id}/tree", "supervision tree")
            if row.debug_port
            else esc("no debug service reported")
        )
        return page(f"Node {row.node_id}", Html(f"{body}<p>{tree}</p>"))

    async def tree(self, node_id: str) -> Html:
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


def _machine_cell(machines: _Machines, row: NodeRow) -> Html:
    """Links to the machines installed with ``row``'s node, ``-`` if none
    (a node installed by hand, or the bootstrap node)."""
    if isinstance(machines, str):
        return Html(f'<span class="state-failed">{esc(machines)}</span>')
    found = machines.get(row.public_key, ())
    if not found:
        return Html('<span class="dim">-</span>')
    return Html(" ".join(link(f"/machine/{m}", m, **{"class": "mono machine"}) for m in found))


_NODE_COLUMNS = (
    "node", "machine", "address", "state", "roles", "curator", "health", "heartbeat",
    "image", "slot", "debug",
)  # fmt: skip


def _image(row: NodeRow) -> Html:
    """The image's short digest, the whole one in its title."""
    if not row.image:
        return Html('<span class="dim">-</span>')
    return Html(f'<span class="mono" title="{esc(row.image)}">{esc(row.short_image)}</span>')


def _slot_text(row: NodeRow) -> str:
    if row.slot == "-":
        return "none (a loopback disk, or a node run by hand)"
    if row.trial:
        return f"{row.slot}: a one-shot try, not yet permanent"
    return f"{row.slot} (permanent)"


def _rollback(row: NodeRow) -> Html:
    if not row.rolled_back:
        return Html('<span class="dim">-</span>')
    return Html(
        f'<span class="mono">{esc(row.rolled_back)}</span>: '
        f'<span class="state-failed">{esc(row.rollback_cause or "no cause given")}</span>'
    )


def _addresses(view: ClusterView) -> Html:
    return Html(", ".join(f"<code>{esc(a)}</code>" for a in view.curators()))


def _curator(row: NodeRow) -> Html:
    if row.leader:
        return Html('<b class="leader">leader</b>')
    return esc("yes" if row.curator else "-")


def _since(seconds: float | None) -> str:
    return "-" if seconds is None else f"{duration(seconds)} ago"


def _unreachable_page(title: str, e: _Unreachable) -> Html:
    tried = ", ".join(f"<code>{esc(a)}</code>" for a in e.addresses) or "no address known"
    body = Html(
        f'<p class="unreachable">Cannot reach {esc(e.what)} (tried {tried}).</p>'
        f'<p>Error: <span class="state-failed">{esc(e.error)}</span></p>'
    )
    return page(title, body)


def _tree_page(title: str, address: str, answer: m.GetSupervisionTreeResponse) -> Html:
    now = datetime.datetime.now(datetime.UTC)
    rows = table(
        ("runnable", "state", "restarts", "last error", "when"),
        (
            (
                Html(f'<span class="mono">{esc(r.name)}</span>'),
                _state(r.state),
                r.restarts,
                r.last_error or "",
                ago(r.last_error_at, now),
            )
            for r in answer.runnables
        ),
        empty="no runnables",
    )
    intro = Html(f"<p>As node <code>{esc(answer.node_id)}</code> reports it at {esc(address)}.</p>")
    return page(title, Html(intro + rows), footer=f"{len(answer.runnables)} runnables")


def _state(state: m.SupervisedRunnableState) -> Html:
    name = m.SupervisedRunnableState(state).name or "UNKNOWN"
    css = "state-failed" if state == m.SupervisedRunnableState.BACKOFF else f"state-{name.lower()}"
    return Html(f'<span class="{esc(css)}">{esc(name)}</span>')
