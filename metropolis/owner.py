"""The owner's side of the cluster: register tickets, approvals, roles, deletion, the
node table, a node's supervision tree.

Used by ``python -m metropolis owner (--cluster FILE | --root DIR) --owner-key
FILE ...`` (:mod:`metropolis.__main__`). ``FILE`` is what ``owner info
--out`` writes (the cluster CA and directory): with it and the owner key
the owner works from any machine, without any node's disk
(:func:`load_owner_from_cluster`). ``DIR`` is the root of any node of the
cluster: the CA and directory are read there instead (:func:`load_owner`).
Either way the owner's certificate is escrowed from a curator
(``AAA.Escrow``, :func:`escrow_certificate`: a proof of possession of the
owner key buys it), unless the root is the bootstrap node's, which keeps
one (:func:`~metropolis.roleserve.disk.owner_certificate_path`). Every
call goes to the leading curator through :mod:`metropolis.rpc`, which
moves to the leader a follower names; the node table alone is read from a
follower while no curator leads (:meth:`Owner.nodes`, rows marked stale).

The root is checked as every entry point checks it
(:meth:`~metropolis.localstorage.Root.check`, through
:func:`~metropolis.roleserve.disk.load`), and refused, not merely warned
about, if another user could have changed it: the CA certificate read
there decides whom the owner's key authenticates to, so a swapped one
would hand the owner's calls (approvals, tickets) to someone else. The
same holds for the cluster file: keep it where only the owner can write.

Errors: :class:`~metropolis.rpc.RPCError` from the curators,
:class:`OwnerError` for local problems (missing files, unknown node).
"""

from __future__ import annotations

import random
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.backoff import ExponentialBackoff, Retrier
from common.text import printable
from metropolis import identity, pki
from metropolis.errors import MetropolisError
from metropolis.localstorage import LocalStorageError, Root
from metropolis.proto import aaa, parameters
from metropolis.proto import management as m
from metropolis.proto.common import NodeState, NodeStatusRunningImageSlot, role_names
from metropolis.roleserve import disk
from metropolis.rpc import (
    CURATOR_PORT,
    Client,
    Endpoint,
    RPCError,
    Status,
    client_context,
    endpoints_from_directory,
    methods,
    open_client,
)
from metropolis.rpc.method import STALE_OK_HEADER

__all__ = [
    "Change",
    "NodeRow",
    "Owner",
    "OwnerAccess",
    "OwnerError",
    "describe_change",
    "escrow_certificate",
    "format_age",
    "format_table",
    "format_tree",
    "load_owner",
    "load_owner_from_cluster",
    "open_owner",
    "role_names",
]


#: How long `Owner.nodes` retries a stale read that no curator can serve
#: yet (their etcd is electing a leader), in seconds: about an etcd
#: election, and well inside the console's own call timeout, so that a
#: cluster with no curator left is reported as such.
STALE_READ_PATIENCE = 3.0
_STALE_READ_BACKOFF = ExponentialBackoff(initial=0.1, maximum=1.0, jitter=(0.8, 1.2))


class OwnerError(MetropolisError):
    """The owner's files are missing or a node named on the command line is unknown."""


class NodeNotFinished(OwnerError):
    """The node root is still being bootstrapped (or registered): not yet,
    its owner's files are not all there; the same call later may succeed."""


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
    #: Its etcd member: ``voter``, ``learner``, ``none``, or ``?`` (unknown).
    etcd: str = "?"
    #: Served by a curator that did not lead (no curator led then): the
    #: records are its etcd's, but heartbeats may have gone unrecorded.
    stale: bool = False
    #: What the node runs, as it reports it: ``sha256:<hex>`` of its image
    #: ("" if it runs from source or reported none).
    image: str = ""
    #: The disk slot it booted from: ``A``, ``B``, or ``-`` (none: a
    #: loopback disk, or a node run by hand).
    slot: str = "-"
    #: Booted for a one-shot try of a new slot, not yet permanent.
    trial: bool = False
    #: The image the node's machine last went back from, and why ("": none).
    rolled_back: str = ""
    rollback_cause: str = ""

    @property
    def curator_state(self) -> str:
        """``LEADER``, ``yes``, ``down`` (its heartbeat timed out) or ``-``."""
        if self.leader:
            return "LEADER"
        if not self.curator:
            return "-"
        return "down" if self.health == "HEARTBEAT_TIMEOUT" else "yes"

    @property
    def short_image(self) -> str:
        """The image's first 12 hex digits, or ``-``."""
        return self.image.removeprefix("sha256:")[:12] or "-"

    @property
    def slot_state(self) -> str:
        """``A``, ``B``, ``B:trial`` (a one-shot try), or ``-``."""
        return f"{self.slot}:trial" if self.trial and self.slot != "-" else self.slot


_SLOTS = {NodeStatusRunningImageSlot.A: "A", NodeStatusRunningImageSlot.B: "B"}

_ETCD = {
    m.NodeEtcdMembership.VOTER: "voter",
    m.NodeEtcdMembership.LEARNER: "learner",
    m.NodeEtcdMembership.NONE: "none",
}


def _sort_key(row: NodeRow) -> tuple[bool, tuple[int, ...], str, str]:
    """By address (numerically for IPv4: 127.0.0.10 after 127.0.0.9), no address last."""
    parts = row.address.split(".")
    numeric = tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else ()
    return (not row.address, numeric, row.address, row.node_id)


@dataclass(frozen=True)
class Change:
    """A node before and after an owner's call (``after`` None: it is gone).

    ``pending``: what was asked for and accepted but is not in effect yet
    (revoking ConsensusMember from the leading curator's own node is
    completed by the next leader), e.g. ``("ConsensusMember revoke",)``.
    """

    before: NodeRow
    after: NodeRow | None
    pending: tuple[str, ...] = ()


def describe_change(change: Change) -> str:
    """One line of what changed: state, roles, etcd membership, or that nothing did."""
    before, after = change.before, change.after
    name = before.node_id
    if after is None:
        parts = [f"deleted {name} (address {before.address or 'none'})"]
        if before.roles:
            parts.append(f"roles {','.join(before.roles)} gone with it")
        if before.etcd in ("voter", "learner"):
            parts.append(f"its etcd member ({before.etcd}) removed")
        if before.state == "UP":
            parts.append("its certificate revoked: curators refuse it from now on")
        return "; ".join(parts)
    changes = []
    if after.state != before.state:
        changes.append(f"state {before.state} -> {after.state}")
    granted = [r for r in after.roles if r not in before.roles]
    revoked = [r for r in before.roles if r not in after.roles]
    changes += [f"{r} granted" for r in granted] + [f"{r} revoked" for r in revoked]
    if after.etcd != before.etcd:
        changes.append(f"etcd {before.etcd} -> {after.etcd}")
    roles = f"(roles now {','.join(after.roles) or 'none'})"
    waiting = [
        f"{p} accepted, not in effect yet (the curators complete it)" for p in change.pending
    ]
    if not changes and not waiting:
        return f"{name}: nothing changed (roles {','.join(after.roles) or 'none'})"
    return f"{name}: " + "; ".join(changes + waiting) + f" {roles}"


class Owner:
    """The owner's calls, on one open client to the curators.

    ``context`` (the owner's TLS identity) is used again to call a node's
    own debug service (:meth:`supervision_tree`).
    """

    def __init__(self, client: Client, context: ssl.SSLContext) -> None:
        self.client = client
        self._context = context

    async def nodes(self) -> list[NodeRow]:
        """Every node, sorted by address (:func:`_sort_key`).

        From the leading curator; if no curator can take the call as leader
        (UNAVAILABLE: a failover, until the dead leader's lease runs out),
        from any curator that answers, each row marked ``stale``.
        """
        try:
            return await self._nodes(stale_ok=False)
        except RPCError as e:
            if e.code is not Status.UNAVAILABLE:
                raise
        # A follower may itself be briefly unable to read: etcd elects a new
        # leader when the dead curator's node led it too ("leader changed").
        retrier = Retrier(_STALE_READ_BACKOFF, random.Random())
        deadline = trio.current_time() + STALE_READ_PATIENCE
        while True:
            try:
                return await self._nodes(stale_ok=True)
            except RPCError as e:
                left = deadline - trio.current_time()
                if e.code is not Status.UNAVAILABLE or left <= 0:
                    raise
                await retrier.sleep(at_most=left)

    async def _nodes(self, *, stale_ok: bool) -> list[NodeRow]:
        metadata = {STALE_OK_HEADER: "1"} if stale_ok else None
        async with self.client.stream(
            methods.GET_NODES, m.GetNodesRequest(), metadata=metadata
        ) as call:
            rows = []
            async for node in call:
                status = node.status
                address = status.external_address if status else ""
                image = status.image if status else None
                rows.append(
                    NodeRow(
                        node_id=identity.node_id(node.pubkey),
                        public_key=node.pubkey,
                        address=address,
                        state=NodeState(node.state).name,
                        roles=role_names(node.roles),
                        curator=bool(status and status.running_curator),
                        leader=(
                            not stale_ok and bool(address) and address == self.client.endpoint.host
                        ),
                        debug_port=status.debug_port if status else 0,
                        health=m.NodeHealth(node.health).name,
                        since_heartbeat=(
                            node.time_since_heartbeat.total_seconds()
                            if node.time_since_heartbeat is not None
                            else None
                        ),
                        etcd=_ETCD.get(node.etcd_membership, "?"),
                        stale=stale_ok,
                        image=image.digest if image else "",
                        slot=_SLOTS.get(image.slot, "-") if image else "-",
                        trial=bool(image and image.trial),
                        rolled_back=image.rolled_back_digest if image else "",
                        rollback_cause=image.rollback_cause if image else "",
                    )
                )
        return sorted(rows, key=_sort_key)

    async def current(self, before: NodeRow) -> NodeRow | None:
        """The node of ``before`` now (None: gone), as :meth:`nodes` reads it.

        A call that made the leader resign (revoking its own node's
        ConsensusMember) is followed by a failover: the row then comes
        from a follower.
        """
        for row in await self.nodes():
            if row.node_id == before.node_id:
                return row
        return None

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
    ) -> Change:
        """Grant or revoke roles of ``node``; the node before and after.

        Granting ConsensusMember waits while etcd refuses the new member
        (it admits one only once its leader is connected to every peer).
        """
        before = await self.row(node)
        await self.client.unary(
            methods.UPDATE_NODE_ROLES,
            m.UpdateNodeRolesRequest(
                pubkey=before.public_key,
                consensus_member=consensus_member,
                kubernetes_controller=kubernetes_controller,
            ),
        )
        after = await self.current(before)
        pending: list[str] = []
        wanted = (
            ("ConsensusMember", consensus_member),
            ("KubernetesController", kubernetes_controller),
        )
        for role, on in wanted:
            if on is not None and after is not None and (role in after.roles) != on:
                pending.append(f"{role} {'grant' if on else 'revoke'}")
        return Change(before, after, tuple(pending))

    async def delete(self, node: str, *, force: bool = False) -> Change:
        """Delete ``node`` from the cluster; the node before (``after`` None).

        The curator refuses (FAILED_PRECONDITION) a node that holds roles,
        unless ``force`` and its heartbeat has timed out; its etcd member
        goes and its certificate is revoked. :class:`OwnerError` if the
        curator still lists it after answering.
        """
        before = await self.row(node)
        await self.client.unary(
            methods.DELETE_NODE,
            m.DeleteNodeRequest(
                pubkey=before.public_key,
                safety_bypass_has_roles=(
                    m.DeleteNodeRequestSafetyBypassHasRoles() if force else None
                ),
            ),
        )
        after = await self.current(before)
        if after is not None:
            raise OwnerError(f"{before.node_id} is still listed after its deletion")
        return Change(before, None)

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


async def escrow_certificate(
    endpoints: list[Endpoint], ca_certificate: x509.Certificate, owner_key: Ed25519PrivateKey
) -> x509.Certificate:
    """An owner certificate from any curator of ``endpoints`` (``AAA.Escrow``).

    Proves possession of ``owner_key``; no certificate needed. Curators
    that refuse the connection or the call as unavailable are skipped
    (any curator answers, the leader or not). :class:`RPCError` from the
    last curator if none issues one (PERMISSION_DENIED: not the owner's
    key); :class:`OwnerError` if what came back is not a certificate of
    the cluster CA for this key.
    """
    context = client_context(ca_certificate)
    last: RPCError | None = None
    for endpoint in endpoints:
        try:
            async with (
                open_client([endpoint], context, proof_key=owner_key) as client,
                client.bidi(methods.ESCROW) as call,
            ):
                await call.send(
                    aaa.EscrowFromClient(
                        parameters=aaa.EscrowFromClientParameters(
                            requested_identity_name="owner",
                            public_key=pki.public_key_bytes(owner_key),
                        )
                    )
                )
                await call.done_sending()
                emitted = b""
                async for answer in call:
                    emitted = answer.emitted_certificate or emitted
        except RPCError as e:
            if e.code is not Status.UNAVAILABLE:
                raise
            last = e
            continue
        try:
            certificate = pki.decode_certificate(emitted)
            pki.verify_signed_by(certificate, ca_certificate)
            key = pki.public_key_bytes(pki.certificate_public_key(certificate))
        except pki.PKIError as e:
            raise OwnerError(
                f"the curator at {endpoint.address} escrowed no usable certificate: {e}"
            ) from e
        if key != pki.public_key_bytes(owner_key):
            raise OwnerError(
                f"the curator at {endpoint.address} escrowed a certificate for another key"
            )
        return certificate
    assert last is not None
    raise last


@dataclass(frozen=True)
class OwnerAccess:
    """What the owner needs to call a cluster: its curators, the CA and the owner key.

    Read once (:func:`load_owner`, :func:`load_owner_from_cluster`); each
    :meth:`open` connects anew, so a long-running program (the web UI)
    follows curators that come and go. ``certificate``: the owner's, if
    one was found on disk; otherwise the first :meth:`open` escrows one
    and keeps it.
    """

    endpoints: list[Endpoint]
    ca_certificate: x509.Certificate
    owner_key: Ed25519PrivateKey
    certificate: x509.Certificate | None = None
    _escrowed: list[x509.Certificate] = field(default_factory=list, compare=False, repr=False)

    async def tls_context(self) -> ssl.SSLContext:
        """The owner's TLS identity; escrows the certificate on first use."""
        if self.certificate is None and not self._escrowed:
            self._escrowed.append(
                await escrow_certificate(self.endpoints, self.ca_certificate, self.owner_key)
            )
        return self.context

    @property
    def context(self) -> ssl.SSLContext:
        """The owner's TLS identity once known: on disk, or escrowed by an earlier call.

        :class:`OwnerError` before that (use :meth:`tls_context`).
        """
        certificate = self.certificate or (self._escrowed[0] if self._escrowed else None)
        if certificate is None:
            raise OwnerError("no owner certificate yet: it is escrowed at the first call")
        return client_context(self.ca_certificate, certificate, self.owner_key)

    @asynccontextmanager
    async def open(self) -> AsyncIterator[Owner]:
        """An :class:`Owner` on a new client (after the escrow, if one is due)."""
        context = await self.tls_context()
        async with open_client(self.endpoints, context) as client:
            yield Owner(client, context)


def load_owner(root: Root, owner_key: Ed25519PrivateKey) -> OwnerAccess:
    """The owner's access through the node root ``root``; :class:`OwnerError` if unusable.

    Any finished node's root: the bootstrap node's keeps the owner's
    certificate, any other's leads to an escrow at the first call.
    """
    try:
        saved = disk.load(root)
        certificate_path = disk.owner_certificate_path(root)
        certificate = (
            pki.decode_certificate(certificate_path.read_bytes())
            if certificate_path.exists()
            else None
        )
    except (OSError, LocalStorageError, pki.PKIError) as e:
        raise OwnerError(f"cannot read the owner's files in {root.path}: {e}") from e
    if saved.credentials is None or saved.directory is None:
        raise NodeNotFinished(f"{root.path} is not a finished node (yet: try again)")
    endpoints = endpoints_from_directory(saved.directory, saved.settings.curator_port)
    return OwnerAccess(endpoints, saved.credentials.ca_certificate, owner_key, certificate)


def load_owner_from_cluster(
    path: Path, owner_key: Ed25519PrivateKey, curator_port: int = CURATOR_PORT
) -> OwnerAccess:
    """The owner's access from a cluster file (``owner info --out``): CA and directory.

    Needs no node's disk: the owner certificate is escrowed at the first
    call. :class:`~metropolis.proto.parameters.NodeParametersError` (an
    :class:`~metropolis.errors.MetropolisError`) names the file if it is
    not one.
    """
    info = parameters.read_cluster_info(path)
    assert info.cluster_directory is not None  # read_cluster_info refuses a file without
    endpoints = endpoints_from_directory(info.cluster_directory, curator_port)
    return OwnerAccess(endpoints, pki.decode_certificate(info.ca_certificate), owner_key)


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
    """The node table: id, address, state, health, last heartbeat, curator, etcd,
    image, slot, roles.

    Curator: LEADER, yes, down (its heartbeat timed out) or -. Image: its
    first 12 hex digits; slot: A, B, B:trial (a one-shot try) or -. A node
    whose machine went back from a slot gets a line saying which image and
    why. Rows a follower served (no curator led) end with a line saying so.
    """
    lines = [
        f"{'NODE':<44} {'ADDRESS':<16} {'STATE':<17} {'HEALTH':<17} {'LAST HEARTBEAT':<14} "
        f"{'CURATOR':<8} {'ETCD':<8} {'IMAGE':<12} {'SLOT':<8} ROLES"
    ]
    for r in rows:
        lines.append(
            f"{r.node_id:<44} {r.address or '-':<16} {r.state:<17} {r.health:<17} "
            f"{format_age(r.since_heartbeat):<14} {r.curator_state:<8} {r.etcd:<8} "
            f"{r.short_image:<12} {r.slot_state:<8} {','.join(r.roles) or '-'}"
        )
    for r in rows:
        if r.rolled_back:
            lines.append(
                f"({r.node_id} went back to slot {r.slot} from image {r.rolled_back}: "
                f"{printable(r.rollback_cause) or 'no cause given'})"
            )
    if any(r.stale for r in rows):
        lines.append(
            "(no curator leads now: read from a follower's etcd; heartbeats and health "
            "may be stale until a new leader is elected)"
        )
    return "\n".join(lines)
