"""The consensus service: this node's etcd member, run under the supervisor.

Startup decides where the peer TLS material comes from::

    JoinCluster given? ──yes──> write CA, peer cert, our key, CRL to data/etcd
          │ no                  start etcd as a member of the existing cluster
          v
    peer PKI on disk? ──yes──> check it is intact and ours; start etcd on its data
          │ no
          v
    bootstrap: make the CA, CRL and our peer certificate here, write them
    to disk (the CA key too, as "bootstrap_ca_key.pem"), start etcd once with
    peer TLS as a new one-member cluster, store the PKI *in etcd*
    (create-if-absent), then delete the CA key file.

Keeping the PKI inside etcd lets any member issue peer certificates later
(``Status.add_node``). Making it before etcd runs means bootstrap starts
etcd once (starting it twice, first with plain-HTTP peers, cost 3.2x a bare
start). A crash anywhere in between resumes: while the CA key file exists,
the PKI is not in etcd yet; if etcd never ran, everything is made anew.

While the CA key file exists nobody can have joined either, so this node's
own join data is known before etcd starts (``Service.bootstrap_join``, given
out once etcd's server has started: the caller writes its files while etcd
waits for its first election), and the caller's first writes
(``Config.on_bootstrap``: the curator's cluster) go to etcd beside the PKI
store, in the same round trip, before the status says running. The PKI's
fsync waits for etcd's server start too: work beside etcd's own start-up,
on two cores and one disk, slowed it by 10-20 ms.

Once etcd answers and this member is a voter, two children run beside it,
in a supervisor scope that ends before the etcd client they use is closed::

    consensus ──┬── etcd process (run_etcd; its log under "<name>.etcd")
                └── scope ──┬── promoter: the raft leader turns caught-up learners into voters
                            └── crl:      etcd's CRL key ──watch──> data/etcd/peer_crl.pem

and ``status`` (a read-only view) says running. If etcd dies, the runnable
fails and the supervisor restarts it, on the same data; but when etcd exits
by itself because its member was removed from the cluster (status 0, or
etcd's known panic in that moment: see ``_Removed``) the runnable logs one
WARNING and waits, status not running, to be
stopped or restarted by its owner when the node's roles change. When the runnable
ends for any reason, ``status`` goes back to not running and the children
are stopped, then the client is closed, and the etcd process is stopped
before ``run`` returns.

Files are written with fsync (``atomic_write``) in a worker thread, so a slow
disk does not stall the other tasks of the node.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal, TypeVar
from urllib.parse import urlsplit

import trio
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from metropolis import identity, pki
from metropolis.consensus import peerpki
from metropolis.consensus.client import (
    GRPC_NOT_FOUND,
    KV,
    Client,
    EndpointStatus,
    EtcdAPIError,
    EtcdUnavailable,
    Member,
)
from metropolis.consensus.process import (
    SOCKET_NAME,
    EtcdExited,
    PeerTLS,
    ProcessConfig,
    Tuning,
    run_etcd,
)
from metropolis.errors import ConsensusError
from metropolis.event import ReadOnlyValue, Value
from metropolis.gather import gather
from metropolis.localstorage import EtcdDataDirectory, atomic_write, make_durable
from metropolis.proto.common import NodeRolesConsensusMember, NodeRolesConsensusMemberPeer
from metropolis.supervisor import Node

__all__ = [
    "CURATOR_NAMESPACE",
    "DEFAULT_PEER_PORT",
    "REMOVAL_PANIC",
    "Config",
    "ConsensusError",
    "ExistingNode",
    "JoinCluster",
    "NotRunning",
    "Service",
    "Status",
]

#: Port peers use when nothing else is said (the node's consensus port).
DEFAULT_PEER_PORT = 7834

#: Where the curator keeps its data in etcd.
CURATOR_NAMESPACE = b"namespaced/curator/"

_T = TypeVar("_T")

#: The new peer CA's key, on disk only from bootstrap until etcd stores it.
_PENDING_CA_KEY = "bootstrap_ca_key.pem"


class NotRunning(ConsensusError):
    """The local etcd member is not running (yet, or any more)."""


@dataclass(frozen=True)
class ExistingNode:
    """A member of the cluster a node is joining: its etcd name and peer URL."""

    name: str
    url: str


@dataclass(frozen=True)
class JoinCluster:
    """What a node needs to join an existing consensus cluster (from ``add_node``)."""

    ca_certificate: x509.Certificate
    #: The joining node's peer certificate, for its own key.
    node_certificate: x509.Certificate
    initial_crl: x509.CertificateRevocationList
    #: Every current member (including not-yet-started learners) except the joiner.
    existing_nodes: tuple[ExistingNode, ...]

    def to_proto(self) -> NodeRolesConsensusMember:
        """The ConsensusMember role that carries this join data (DER encodings)."""
        der = pki.Encoding.DER
        return NodeRolesConsensusMember(
            ca_certificate=pki.encode_certificate(self.ca_certificate, der),
            peer_certificate=pki.encode_certificate(self.node_certificate, der),
            initial_crl=pki.encode_crl(self.initial_crl, der),
            peers=[
                NodeRolesConsensusMemberPeer(name=n.name, url=n.url) for n in self.existing_nodes
            ],
        )

    def check(self, node_private_key: Ed25519PrivateKey) -> None:
        """Raise :class:`ConsensusError` unless this join data is for that node's key.

        Checks that the peer certificate certifies the key and is signed by
        the CA, and that the CRL is the CA's. Pure; usable before etcd starts
        (the role server uses it to skip bad roles instead of failing later).
        """
        own_key = pki.public_key_bytes(node_private_key)
        try:
            cert_key = pki.public_key_bytes(pki.certificate_public_key(self.node_certificate))
            pki.verify_signed_by(self.node_certificate, self.ca_certificate)
            pki.verify_crl(self.initial_crl, self.ca_certificate)
        except pki.PKIError as e:
            raise ConsensusError(f"join data does not verify: {e}") from e
        if cert_key != own_key:
            raise ConsensusError("join data: peer certificate is not for this node's key")

    @classmethod
    def from_proto(cls, role: NodeRolesConsensusMember) -> JoinCluster:
        """Parse a ConsensusMember role. :class:`ConsensusError` says which part is bad.

        Only parses: whether the parts fit this node's key is checked when
        the service starts with them.
        """
        try:
            ca = pki.decode_certificate(role.ca_certificate)
        except pki.PKIError as e:
            raise ConsensusError(f"ConsensusMember role: CA certificate: {e}") from e
        try:
            certificate = pki.decode_certificate(role.peer_certificate)
        except pki.PKIError as e:
            raise ConsensusError(f"ConsensusMember role: peer certificate: {e}") from e
        try:
            crl = pki.decode_crl(role.initial_crl)
        except pki.PKIError as e:
            raise ConsensusError(f"ConsensusMember role: initial CRL: {e}") from e
        peers = tuple(ExistingNode(p.name, p.url) for p in role.peers)
        return cls(ca, certificate, crl, peers)


@dataclass(frozen=True)
class Config:
    """How to run this node's consensus member."""

    #: ``data/etcd``: etcd data, peer PKI, CRL.
    data: EtcdDataDirectory
    #: etcd's working directory (``ephemeral/consensus``); the client socket lives here.
    ephemeral: Path
    node_private_key: Ed25519PrivateKey
    #: ``host:port`` to listen on for peers; also the address advertised to them.
    peer_address: str
    #: Set to join an existing cluster; None to bootstrap (or restart from disk).
    join_cluster: JoinCluster | None = None
    tuning: Tuning = field(default_factory=Tuning)
    #: The longest the promoter goes without looking for learners to promote
    #: (it looks at once when one is added, and often while one waits).
    promote_interval: float = 5.0
    #: How long ``add_node`` keeps retrying while etcd refuses membership changes.
    membership_timeout: float = 60.0
    #: On a bootstrap (a run that stores the bootstrap PKI), called once etcd
    #: answers, concurrently with that store and before ``running`` is
    #: published: with the curator's view of etcd (``Status.curator_client``)
    #: and this node's join data (``Service.bootstrap_join``). Lets the first
    #: node create its cluster's curator state in the same round trip (etcd
    #: commits concurrent writes with one WAL fsync). Not called on other
    #: runs: the caller then falls back to a running ``Status``.
    on_bootstrap: Callable[[KV, JoinCluster], Awaitable[None]] | None = field(
        default=None, compare=False
    )

    @property
    def node_id(self) -> str:
        return identity.node_id(self.node_private_key.public_key())

    @property
    def peer_url(self) -> str:
        return f"https://{self.peer_address}"

    @property
    def client_socket(self) -> Path:
        """Where etcd's client socket appears while the member runs."""
        return self.ephemeral / SOCKET_NAME

    def _process(
        self, *, peer_tls: bool, initial: dict[str, str], state: Literal["new", "existing"]
    ) -> ProcessConfig:
        pki_dir = self.data.peer_pki
        tls = PeerTLS(
            ca_certificate=pki_dir.ca_certificate,
            certificate=pki_dir.certificate,
            key=pki_dir.key,
            crl=self.data.peer_crl,
        )
        return ProcessConfig(
            name=self.node_id,
            data_dir=self.data.data,
            working_dir=self.ephemeral,
            peer_address=self.peer_address,
            peer_tls=tls if peer_tls else None,
            initial_cluster=initial,
            cluster_state=state,
            tuning=self.tuning,
        )


@dataclass(frozen=True)
class Status:
    """A snapshot of the consensus service, published through ``Service.status``.

    While ``running``, the methods talk to the local etcd member; once a
    newer status says not running, clients from this one fail with
    :class:`~metropolis.consensus.client.EtcdUnavailable`.
    """

    running: bool
    node_id: str
    peer_url: str
    member_id: int = 0
    _client: Client | None = field(default=None, repr=False, compare=False)
    _config: Config | None = field(default=None, repr=False, compare=False)
    #: Wakes this node's promoter when ``add_node`` added a learner.
    _nudge: _Nudge | None = field(default=None, repr=False, compare=False)

    def _running(self) -> tuple[Client, Config]:
        if not self.running or self._client is None or self._config is None:
            raise NotRunning("consensus is not running")
        return self._client, self._config

    def curator_client(self) -> KV:
        """The curator's view of etcd: keys under ``namespaced/curator/``."""
        client, _ = self._running()
        return client.namespaced(CURATOR_NAMESPACE)

    async def add_node(
        self,
        public_key: bytes,
        *,
        peer_url: str | None = None,
        members: list[Member] | None = None,
        node_pki: peerpki.NodePKI | None = None,
    ) -> JoinCluster:
        """Make the node with ``public_key`` a (future) member; return its join data.

        Issues (or reuses) its peer certificate and, unless a member with
        ``peer_url`` exists already, adds it as a non-voting learner; the
        promoter makes it a voter once it has caught up. Idempotent, so it
        also serves a node that is already a member (the bootstrapping node
        asks for its own join data this way).

        ``peer_url`` defaults to this node's own URL for its own key; for any
        other node it must be given (``ValueError`` otherwise): a guessed URL
        would add a member nobody can reach, and etcd then refuses every
        further membership change until it is removed. etcd refuses
        membership changes for a few seconds after one (and accepts only one
        learner at a time); those refusals are retried for
        ``Config.membership_timeout``, then :class:`ConsensusError` is raised.

        ``members``: etcd's member list, and ``node_pki``: what
        :meth:`load_node_pki` returned for this node, if the caller has just
        read them (alongside its own reads: round trips less).
        """
        client, config = self._running()
        node = identity.node_id(public_key)
        if peer_url is None:
            if node != self.node_id:
                raise ValueError(f"add_node({node}): another node's peer URL must be given")
            peer_url = self.peer_url
        host = urlsplit(peer_url).hostname
        if not host:
            raise ValueError(f"peer URL {peer_url!r} has no host")

        pki_kv = client.namespaced(peerpki.NAMESPACE)

        # Independent reads at once, the PKI ones in one txn: one round trip
        # instead of four on the bootstrap and grant paths, which wait on each.
        async def load_pki() -> peerpki.NodePKI:
            return node_pki or await peerpki.load_for_node(pki_kv, node)

        async def list_members() -> list[Member]:
            return members if members is not None else await client.member_list()

        state, current = await gather(load_pki, list_members)
        ca, crl = state.ca, state.crl
        hosts = [host]
        if _is_loopback(host) and host != "127.0.0.1":
            # etcd checks a peer's client certificate against the address the
            # connection comes from, and Linux sends every connection between
            # loopback addresses from 127.0.0.1 (the source of lo's local
            # route). A cluster on 127.0.0.1/2/3 needs that address too; it
            # grants nothing beyond this host.
            hosts.append("127.0.0.1")

        async def certificate() -> x509.Certificate:
            return await peerpki.reuse_or_issue(
                pki_kv, ca, public_key, hosts, crl, state.stored_certificate
            )

        async def add_learner() -> list[Member]:
            member, after = await _add_learner(client, peer_url, config.membership_timeout)
            logging.getLogger("metropolis.consensus").info(
                "added %s (%s) as learner %x", node, peer_url, member.id
            )
            if self._nudge is not None:
                self._nudge.set(_LOOK)
            return after

        if any(peer_url in m.peer_urls for m in current):
            issued = await certificate()
        else:
            # The certificate's write and the member's addition at once: they
            # are independent, and nothing hands the certificate out before
            # both are done (the caller stores the join data afterwards). If
            # one fails, a retry finds the other done (reused or skipped); a
            # learner left without join data is removed as a stuck learner.
            issued, current = await gather(certificate, add_learner)
        existing = tuple(
            # A learner that has not started yet has no name; etcd matches
            # --initial-cluster by URL, so any unique placeholder will do.
            ExistingNode(m.name or f"unstarted-{m.id:x}", m.peer_urls[0])
            for m in current
            if peer_url not in m.peer_urls and m.peer_urls
        )
        return JoinCluster(ca.certificate, issued, crl, existing)

    async def load_node_pki(self, node_id: str) -> peerpki.NodePKI:
        """The peer CA, CRL and certificate stored for ``node_id``, for :meth:`add_node`."""
        client, _ = self._running()
        return await peerpki.load_for_node(client.namespaced(peerpki.NAMESPACE), node_id)

    async def members(self) -> list[Member]:
        """etcd's member list, learners and not-yet-started members included."""
        client, _ = self._running()
        return await client.member_list()

    async def remove_node(self, public_key: bytes) -> x509.CertificateRevocationList:
        """Take the node with ``public_key`` out of the cluster; return the new CRL.

        Removes its etcd member (if it has one), revokes its peer certificate
        so it cannot reconnect, and writes the new CRL to this node's disk at
        once (every member's CRL watcher does the same). Refuses to remove
        this node itself (``ValueError``): a member cannot stop itself
        cleanly this way. Transient refusals are retried as for ``add_node``.
        """
        client, config = self._running()
        node = identity.node_id(public_key)
        if node == self.node_id:
            raise ValueError("remove_node: a member cannot remove itself")
        pki_kv = client.namespaced(peerpki.NAMESPACE)
        ca = await peerpki.load_ca(pki_kv)
        stored = await pki_kv.get(peerpki.KEY_CERTIFICATES + node.encode())
        urls: set[str] = set()
        if stored is not None:
            certificate = pki.decode_certificate(stored.value)
            sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
            urls = {str(ip) for ip in sans.value.get_values_for_type(x509.IPAddress)}
            urls |= set(sans.value.get_values_for_type(x509.DNSName))
        for member in await client.member_list():
            hosts = {urlsplit(u).hostname for u in member.peer_urls}
            if member.name == node or (not member.name and hosts & urls):
                await _remove_member(client, member.id, config.membership_timeout)
                logging.getLogger("metropolis.consensus").info(
                    "removed member %x (%s)", member.id, node
                )
        crl = await peerpki.revoke_peer_certificate(pki_kv, ca, node)
        await trio.to_thread.run_sync(atomic_write, config.data.peer_crl, pki.encode_crl(crl))
        return crl


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: Between two tries of a membership change etcd refused for now.
_MEMBERSHIP_RETRY = 0.5


async def _retry_transient(
    fn: Callable[[], Awaitable[_T]],
    patience: float,
    *,
    applied: Callable[[], Awaitable[_T | None]],
) -> _T:
    """Call ``fn`` until etcd stops refusing it transiently, for at most ``patience`` s.

    A membership change refused transiently may still have applied (it
    timed out, see :data:`~.client.MEMBERSHIP_DEADLINE`), and a repeated
    one would then fail (a member added twice, removed twice). So before
    each retry ``applied()`` looks: what it returns, if not None, is the
    change's result.
    """
    last: EtcdAPIError | None = None
    with trio.move_on_after(patience):
        while True:
            try:
                return await fn()
            except EtcdAPIError as e:
                if not e.transient:
                    raise
                last = e
            await trio.sleep(_MEMBERSHIP_RETRY)
            if (result := await applied()) is not None:
                return result
    raise ConsensusError(f"etcd kept refusing the membership change for {patience}s: {last}")


async def _add_learner(
    client: Client, peer_url: str, patience: float
) -> tuple[Member, list[Member]]:
    """Add ``peer_url`` as a learner; the member and the member list after it.

    Idempotent by peer URL: a member with it found before a retry is the
    one an earlier, timed-out try added.
    """

    async def applied() -> tuple[Member, list[Member]] | None:
        members = await client.member_list()
        added = next((m for m in members if peer_url in m.peer_urls), None)
        return None if added is None else (added, members)

    return await _retry_transient(
        lambda: client.member_add_listing([peer_url], learner=True), patience, applied=applied
    )


async def _remove_member(client: Client, member_id: int, patience: float) -> None:
    """Remove member ``member_id``; done too if it is (or goes) missing meanwhile."""

    async def remove() -> bool:
        try:
            await client.member_remove(member_id)
        except EtcdAPIError as e:
            if e.code != GRPC_NOT_FOUND:
                raise
        return True

    async def applied() -> bool | None:
        return True if all(m.id != member_id for m in await client.member_list()) else None

    await _retry_transient(remove, patience, applied=applied)


class Service:
    """Runs this node's etcd member. ``run`` is a supervisor runnable.

    ``status`` says not running when ``run`` starts and ends, and running
    when the member is up and a voter.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self._status: Value[Status] = Value()
        self._status_view = self._status.readonly()
        self._bootstrap_join: Value[JoinCluster | None] = Value()
        self._bootstrap_join_view = self._bootstrap_join.readonly()

    @property
    def status(self) -> ReadOnlyValue[Status]:
        """The service's :class:`Status`, to watch; only the service sets it."""
        return self._status_view

    @property
    def bootstrap_join(self) -> ReadOnlyValue[JoinCluster | None]:
        """This node's own join data when ``run`` bootstraps a new cluster, known before etcd runs.

        Set by each ``run``: the join data ``Status.add_node`` would return
        for this node's own key (the peer CA, this node's peer certificate,
        the CRL, no other members) when this run creates the cluster or
        resumes a bootstrap whose PKI is not in etcd yet, once etcd's server
        has started (see :func:`~.process.run_etcd`'s ``server_started``),
        before it answers but for a missed log line; None otherwise, before
        etcd starts (joining, restarting, or a bootstrap whose PKI etcd
        holds already: ask ``add_node`` then). It lets the bootstrapping
        node write what depends on its join data while etcd waits for its
        first election, instead of after a round trip to it, and not beside
        etcd's own start, which that slowed down.
        """
        return self._bootstrap_join_view

    async def wait_running(self) -> Status:
        """Wait until the member runs (now or later) and return that status.

        Cancellable; a status that is no longer current when the caller uses
        it fails with :class:`NotRunning` or a closed client, never silently.
        """
        with self.status.watch() as watcher:
            return await watcher.get(lambda s: s.running)

    def _stopped(self) -> Status:
        return Status(running=False, node_id=self.config.node_id, peer_url=self.config.peer_url)

    async def run(self, node: Node) -> None:
        """Run etcd until cancelled. Raises (for the supervisor to restart us) if etcd dies.

        Raises :class:`ConsensusError` before starting anything if the join
        data does not fit our key, or if the on-disk state is inconsistent.
        """
        self._status.set(self._stopped())
        try:
            await self._run(node)
        finally:
            self._status.set(self._stopped())

    async def _run(self, node: Node) -> None:
        config = self.config
        data = config.data
        data.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        data.path.chmod(0o700)
        data.peer_pki.create()
        config.ephemeral.mkdir(mode=0o700, parents=True, exist_ok=True)
        etcd_logger = logging.getLogger(f"{node.name}.etcd")

        own = {config.node_id: config.peer_url}
        join = config.join_cluster
        bootstrap_join: JoinCluster | None = None
        bootstrap_pki: (
            tuple[peerpki.PeerCA, x509.CertificateRevocationList, x509.Certificate] | None
        ) = None
        if join is not None:
            node.logger.info("joining existing cluster via %d members", len(join.existing_nodes))
            unsynced = await self._write_join_pki(join)
            store_pki = False
            initial = own | {n.name: n.url for n in join.existing_nodes}
            process = config._process(peer_tls=True, initial=initial, state="existing")
        else:
            pending = data.path / _PENDING_CA_KEY
            if pending.exists() and not (data.data / "member").exists():
                # A bootstrap that crashed before etcd ever ran: the CA never
                # left this machine, so start over rather than trust half a PKI.
                self._discard_unstarted_bootstrap(node)
            made = None
            if data.peer_pki.all_absent():
                made = self._prepare_bootstrap_pki(node)
            elif not data.peer_pki.all_present():
                raise ConsensusError(f"partial peer PKI in {data.peer_pki.path}: refusing to guess")
            elif not (data.data / "member").exists() and not pending.exists():
                # Starting a fresh single-member cluster here would split the
                # node off the cluster its certificates belong to.
                raise ConsensusError(
                    f"peer PKI present but no etcd data in {data.data}; join data is needed"
                )
            else:
                self._check_peer_pki()
            process = config._process(peer_tls=True, initial=own, state="new")
            # Looked at once: nothing removes the pending key before etcd runs.
            store_pki = pending.exists()
            unsynced = [pending, data.peer_crl, *data.peer_pki.files()] if store_pki else []
            if store_pki:
                # The bootstrap PKI is not in etcd yet (its CA key is still
                # pending on disk), so no node can have been added, nor any
                # certificate revoked: this node's join data is what is on
                # disk, with no other members.
                bootstrap_pki = made or self._load_bootstrap_pki()
                ca, crl, certificate = bootstrap_pki
                bootstrap_join = JoinCluster(ca.certificate, certificate, crl, ())
        if bootstrap_join is None:
            self._bootstrap_join.set(None)

        async with Client(process.socket_path) as client, trio.open_nursery() as nursery:
            # Files written without fsync are made durable while etcd starts;
            # nothing counts on them surviving a power cut before that is done
            # (the bootstrap PKI is not stored in etcd, status is not running).
            synced = trio.Event()
            # On a bootstrap, that fsync and the caller's writes (which wait
            # for the join data) go once etcd's server has started and waits
            # for its first election: beside etcd's own start up to there,
            # on two cores, they made it 10-20 ms slower (measured).
            server_started = trio.Event()
            gate = server_started if store_pki else None
            nursery.start_soon(_make_durable, unsynced, synced, gate)
            if bootstrap_join is not None:
                nursery.start_soon(_set_after, server_started, self._bootstrap_join, bootstrap_join)
            removed = _Removed()
            promoted = _Nudge()
            # The promoter's: it starts once this member votes, but a learner's
            # stream may come up at any time.
            nudge = _Nudge()
            first: EndpointStatus = await nursery.start(
                removed.run_etcd,
                process,
                etcd_logger,
                nursery.cancel_scope,
                server_started,
                promoted.set,
                partial(nudge.set, _PEER_UP),
            )
            removed.ready = True
            # Nothing goes into etcd before the PKI files are durable: a power
            # cut must not leave etcd with a PKI (or curator state naming it)
            # that this node's disk lost.
            await synced.wait()
            if bootstrap_pki is not None:
                async with trio.open_nursery() as bootstrap:
                    bootstrap.start_soon(self._store_bootstrap_pki, node, client, bootstrap_pki)
                    if config.on_bootstrap is not None and bootstrap_join is not None:
                        kv = client.namespaced(CURATOR_NAMESPACE)
                        bootstrap.start_soon(config.on_bootstrap, kv, bootstrap_join)
            member_id = first.member_id
            if first.is_learner:
                await _wait_voter(client, config.tuning, node.logger, promoted)

            # The children borrow the client: the scope ends them before the
            # client is closed. It is left when run_etcd raises EtcdExited
            # (which cancels this block) or when we are cancelled.
            async with node.scope() as sub:
                sub.run("promoter", lambda n: _promoter(n, client, config, nudge))
                sub.run("crl", lambda n: _sync_crl(n, client, config.data.peer_crl))
                self._status.set(
                    Status(
                        running=True,
                        node_id=config.node_id,
                        peer_url=config.peer_url,
                        member_id=member_id,
                        _client=client,
                        _config=config,
                        _nudge=nudge,
                    )
                )
                node.logger.info("etcd member %x running", member_id)
                node.signal_healthy()
                try:
                    await trio.sleep_forever()
                finally:
                    # Withdrawn before the client closes, not after.
                    self._status.set(self._stopped())
        if removed.exited:
            # Only reached when etcd left by itself because its member was
            # removed (otherwise EtcdExited or Cancelled went through the
            # nursery; see _Removed). Restarting
            # it on this data would only see it exit again: the roles that
            # say so arrive through the role fetch, and the launcher then
            # stops this service (or starts it with new join data).
            node.logger.warning(
                "etcd exited by itself: this member was removed from the"
                " cluster; waiting for the role change instead of restarting it"
            )
            await trio.sleep_forever()

    def _check_peer_pki(self) -> None:
        """Refuse peer credentials on disk that are damaged or not this node's.

        etcd fails on an unreadable or mismatched key with a terse TLS error,
        and runs happily with a certificate from a foreign CA (only its peers
        would refuse it), so the files are checked before etcd sees them.
        """
        directory = self.config.data.peer_pki
        try:
            credentials = identity.NodeCredentials.load(directory)
        except identity.CredentialsError as e:
            raise ConsensusError(f"peer PKI: {e}") from e
        if credentials.public_key != pki.public_key_bytes(self.config.node_private_key):
            raise ConsensusError(
                f"peer PKI in {directory.path} is for {credentials.node_id}, "
                f"not this node ({self.config.node_id})"
            )

    async def _write_join_pki(self, join: JoinCluster) -> list[Path]:
        """Check the join data against our key, then write it (owner-only).

        Written without fsync: returns the files written, for the caller to
        make durable while etcd starts. Should they be lost in a power cut,
        the join data (kept in the node's roles) writes them again.
        """
        join.check(self.config.node_private_key)
        directory = self.config.data.peer_pki
        files = {
            directory.ca_certificate: pki.encode_certificate(join.ca_certificate),
            directory.certificate: pki.encode_certificate(join.node_certificate),
            directory.key: pki.encode_private_key(self.config.node_private_key),
        }
        # Join data is replayed on every restart: the files are usually there
        # already, and rewriting them costs three fsyncs on the start path.
        # Written from this thread: without fsync, four small files go to
        # the page cache in microseconds, less than a hop to a worker thread
        # costs (on a loaded machine, milliseconds before etcd can start).
        written: list[Path] = []
        if not all(_has_content(path, data) for path, data in files.items()):
            directory.write_all(
                ca_certificate=files[directory.ca_certificate],
                certificate=files[directory.certificate],
                key=files[directory.key],
                durable=False,
            )
            written += files
        if not self._have_newer_crl(join):
            crl = pki.encode_crl(join.initial_crl)
            atomic_write(self.config.data.peer_crl, crl, durable=False)
            written.append(self.config.data.peer_crl)
        return written

    def _have_newer_crl(self, join: JoinCluster) -> bool:
        """Whether the CRL on disk is at least as new as the join data's.

        Join data is replayed on every restart; its initial CRL must not
        undo revocations that the CRL watcher has written since.
        """
        try:
            current = pki.decode_crl(self.config.data.peer_crl.read_bytes())
            pki.verify_crl(current, join.ca_certificate)
        except (OSError, pki.PKIError):
            return False
        return pki.crl_number(current) >= pki.crl_number(join.initial_crl)

    def _discard_unstarted_bootstrap(self, node: Node) -> None:
        data = self.config.data
        node.logger.warning("resuming a bootstrap that stopped before etcd ran: starting over")
        for path in (*data.peer_pki.files(), data.peer_crl, data.path / _PENDING_CA_KEY):
            path.unlink(missing_ok=True)

    def _prepare_bootstrap_pki(
        self, node: Node
    ) -> tuple[peerpki.PeerCA, x509.CertificateRevocationList, x509.Certificate]:
        """Make a new peer PKI on disk, with the CA key kept aside until etcd has it.

        Returns what it wrote, as :meth:`_load_bootstrap_pki` would read it back.
        """
        config = self.config
        node.logger.info("no peer PKI on disk: bootstrapping a new cluster")
        ca, crl = peerpki.new_ca()
        own_key = pki.public_key_bytes(config.node_private_key)
        certificate = peerpki.issue_local_certificate(
            ca, own_key, peerpki.peer_hosts(config.peer_address)
        )

        # The CA key first: its presence marks a bootstrap in progress. Then
        # the CRL, and the credentials last, so all_present() implies a CRL.
        # Not fsynced here: _run does that while etcd starts,
        # and nothing is stored in etcd before it is done (a power cut before
        # then leaves no PKI in etcd, so a fresh one is made and stored).
        atomic_write(
            config.data.path / _PENDING_CA_KEY, pki.encode_private_key(ca.key), durable=False
        )
        atomic_write(config.data.peer_crl, pki.encode_crl(crl), durable=False)
        config.data.peer_pki.write_all(
            ca_certificate=pki.encode_certificate(ca.certificate),
            certificate=pki.encode_certificate(certificate),
            key=pki.encode_private_key(config.node_private_key),
            durable=False,
        )
        return ca, crl, certificate

    def _load_bootstrap_pki(
        self,
    ) -> tuple[peerpki.PeerCA, x509.CertificateRevocationList, x509.Certificate]:
        """The bootstrap PKI on disk (CA with its pending key, CRL, own certificate)."""
        data = self.config.data
        try:
            ca = peerpki.PeerCA(
                pki.decode_private_key((data.path / _PENDING_CA_KEY).read_bytes()),
                pki.decode_certificate(data.peer_pki.ca_certificate.read_bytes()),
            )
            crl = pki.decode_crl(data.peer_crl.read_bytes())
            certificate = pki.decode_certificate(data.peer_pki.certificate.read_bytes())
        except (OSError, pki.PKIError) as e:
            raise ConsensusError(f"bootstrap PKI on disk is damaged: {e}") from e
        return ca, crl, certificate

    async def _store_bootstrap_pki(
        self,
        node: Node,
        client: Client,
        made: tuple[peerpki.PeerCA, x509.CertificateRevocationList, x509.Certificate],
    ) -> None:
        """Put the PKI made before etcd started (``made``, as on disk) into etcd, then drop
        the CA key file."""
        pending = self.config.data.path / _PENDING_CA_KEY
        # Not read back from disk: that cost ~1 ms of this thread at the
        # moment etcd first answers, and these are the files' contents.
        ca, crl, certificate = made
        await peerpki.store_bootstrap(client.namespaced(peerpki.NAMESPACE), ca, crl, certificate)
        pending.unlink()
        node.logger.info("bootstrap peer PKI stored in etcd")


#: What etcd 3.4 panics with when a client request races the removal of its
#: own member (etcd-io/etcd#21966, #18606): it means "removed" as much as
#: its clean exit does.
REMOVAL_PANIC = "failed to find local ID in cluster members"


class _Removed:
    """Runs etcd and notes whether it left on its own because its member was removed.

    etcd 3.4 stops by itself, with status 0, once it learns that its member
    was removed from the cluster (``member remove``, here the revocation of
    the node's ConsensusMember role). Every stop we ask for cancels
    :func:`run_etcd` instead (SIGTERM, and no :class:`EtcdExited`), so an
    ``EtcdExited(0)`` is etcd's own decision. So is one known crash: a
    client request that reaches etcd while it applies its own removal
    makes it panic (status 2, :data:`REMOVAL_PANIC`) instead of exiting
    cleanly; any request of this node (the promoter's, the curator's) can
    be the one. That panic counts as a removal only once etcd had been
    running: at start it would mean a damaged data directory. Any other
    crash (non-zero status, a signal) is raised, for the supervisor to
    restart etcd.
    """

    def __init__(self) -> None:
        self.exited = False
        #: Set by the caller once etcd answered (``nursery.start`` returned).
        self.ready = False

    async def run_etcd(
        self,
        process: ProcessConfig,
        logger: logging.Logger,
        scope: trio.CancelScope,
        server_started: trio.Event,
        on_promotion: Callable[[], None],
        on_peer_active: Callable[[], None],
        *,
        task_status: trio.TaskStatus[EndpointStatus] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """:func:`run_etcd`; when it leaves because it was removed, cancel ``scope`` and wait.

        Waiting (not returning) keeps ``nursery.start`` from failing when
        etcd leaves before it was ready: the cancellation ends both.
        """
        try:
            await run_etcd(
                process,
                logger,
                task_status=task_status,
                server_started=server_started,
                on_promotion=on_promotion,
                on_peer_active=on_peer_active,
            )
        except EtcdExited as e:
            panicked = e.returncode == 2 and REMOVAL_PANIC in e.fatal and self.ready
            if e.returncode != 0 and not panicked:
                raise
            if panicked:
                # Not "was removed": that is said once, when the service has stopped.
                logger.warning("etcd panicked during its member's removal (a known etcd race)")
        self.exited = True
        scope.cancel()
        await trio.sleep_forever()


async def _make_durable(paths: list[Path], done: trio.Event, after: trio.Event | None) -> None:
    """fsync ``paths`` (in a worker thread, overlapping etcd's start), then set ``done``.

    With ``after``: not before that is set.
    """
    if after is not None:
        await after.wait()
    if paths:
        await trio.to_thread.run_sync(make_durable, paths)
    done.set()


async def _set_after(event: trio.Event, value: Value[_T], new: _T) -> None:
    """Set ``value`` to ``new`` once ``event`` is set."""
    await event.wait()
    value.set(new)


def _has_content(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() == data
    except OSError:
        return False


async def _wait_voter(
    client: Client, tuning: Tuning, logger: logging.Logger, promoted: _Nudge
) -> None:
    """Wait until this member is a voter (learners are promoted by the leader).

    etcd 3.4's status says whether the member behind the socket is a
    learner; a learner cannot watch anything, so this looks: one small call
    on our own socket (0.2 ms of CPU) at once when ``promoted`` is set (etcd
    logged that it applied a promotion, see :func:`run_etcd`), and in any
    case every quarter heartbeat for ten election timeouts (the leader
    promotes a learner within a few heartbeats of it catching up, which it
    has once its client socket answers), then every heartbeat. Looking only
    every quarter heartbeat cost the grant of ConsensusMember an eighth of
    one on average (about 3 ms with loopback tuning) on its critical path.
    """
    logger.info("still a learner, waiting for promotion")
    heartbeat = max(tuning.heartbeat_ms / 1000, 0.01)
    fast_until = trio.current_time() + 10 * tuning.election_ms / 1000
    while True:
        fast = trio.current_time() < fast_until
        with trio.move_on_after(heartbeat / 4 if fast else heartbeat):
            await promoted.wait()
        try:
            status = await client.status()
        except (EtcdAPIError, EtcdUnavailable) as e:
            logger.info("status not available yet: %s", e)
        else:
            if not status.is_learner:
                return


class _Nudge:
    """A wake-up set from any task, taken by one waiter with the reasons given since
    the last: the promoter's (a learner may be on its way, or its stream came up)
    and a learner's own wait for its promotion (etcd logged one)."""

    def __init__(self) -> None:
        self._event = trio.Event()
        self._reasons: set[str] = set()

    def set(self, reason: str = "") -> None:
        self._reasons.add(reason)
        self._event.set()

    async def wait(self) -> frozenset[str]:
        await self._event.wait()
        self._event = trio.Event()
        reasons, self._reasons = frozenset(self._reasons), set()
        return reasons


#: Why the promoter is nudged: a learner may be coming (``add_node``, or a
#: peer certificate issued), so look at the members.
_LOOK = "look"
#: Why the promoter is nudged: etcd logged that a stream to a peer came up,
#: so a learner that waits may now catch up.
_PEER_UP = "peer up"


async def _promoter(node: Node, client: Client, config: Config, nudge: _Nudge) -> None:
    """On the raft leader, promote every started learner; etcd refuses those not caught up.

    Only the leader acts, so members do not all hammer etcd with the same
    promotions; if leadership moves in between, a promotion is merely
    refused or repeated, both harmless.

    When it looks. etcd tells nobody when a learner has caught up (about
    when its client socket answers), so a waiting learner is polled, and
    the promotion comes on average half a retry after it could: on the
    critical path of a grant of ConsensusMember. But a learner cannot catch
    up before its etcd connects to the leader, and the leader's etcd logs
    when a peer's stream comes up (``nudge`` gets :data:`_PEER_UP`):

    - at once when a learner may be coming (``add_node`` on this node
      nudges with :data:`_LOOK`; on any node, ``add_node`` issues the peer
      certificate first, which a watch sees);
    - while a learner waits to connect: every heartbeat, for ten election
      timeouts (a fallback: were the log line missed, the promotion would
      come half a heartbeat late on average);
    - from a peer's stream coming up: every quarter heartbeat, for ten
      election timeouts (a learner's etcd catches up within a few);
    - past those windows, backing off x1.5 up to ``promote_interval``;
      with no learner waiting, every ``promote_interval``.

    Why a learner that connected is still refused for a while: an etcd
    follower holds back its acknowledgements until it has applied every
    committed entry of a batch that holds a configuration change (etcd's
    raft loop: "follower needs to wait for all pending configuration
    changes to be applied before sending messages"). A joining learner's
    first batch is the cluster's whole history, so the leader sees it
    caught up only once it has replayed all of it: about when its client
    socket first answers, and later the more members came and went.

    Why the two rates. A refused promotion is one small call (0.5 ms of
    this thread's CPU, and some of the leader etcd's), and on a grant it
    runs beside the learner's etcd starting up on the same cores: polling
    every quarter heartbeat from the member add on made ten or more calls
    before the learner had even connected (measured). At a full heartbeat
    after it connected, the promotion came 10 ms of a grant's 130 late
    on average (loopback tuning); a quarter heartbeat cut the grant from
    1.81 to 1.67 times etcd's own join (medians of three runs of 8 grants).

    How: a full look (status: do we lead? member list: which learners?)
    when nudged to look and when nothing is known to wait; between those,
    the learners the last look found waiting are promoted directly, one
    call each per retry, as etcd's own procedure goes (member add, start
    the learner, promote until etcd accepts). Full looks (two or three
    calls) at every retry slowed the very learner start they wait for. If
    leadership moved meanwhile, a direct promotion is forwarded or refused
    by etcd; either is harmless, and the next full look (every retry after
    the windows) sees the new state.

    Errors: an unreachable etcd is logged and looked at again later; any
    other etcd error is raised (the supervisor restarts the promoter).
    Cancellation: at any point; a promotion in flight may or may not apply.
    """
    heartbeat = max(config.tuning.heartbeat_ms / 1000, 0.01)
    first_retry = max(heartbeat / 4, 0.005)
    window = 10 * config.tuning.election_ms / 1000
    kv = client.namespaced(peerpki.NAMESPACE)

    async def watch_issued() -> None:
        async with kv.watch(peerpki.KEY_CERTIFICATES, prefix=True) as watch:
            async for _ in watch:
                nudge.set(_LOOK)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_issued)
        node.signal_healthy()
        delay = config.promote_interval
        waiting: set[int] = set()
        start_until = 0.0  # until then, a waiting learner is retried every heartbeat
        fast_until = 0.0  # until then, every quarter heartbeat
        while True:
            reasons: frozenset[str] = frozenset()
            with trio.move_on_after(delay):
                reasons = await nudge.wait()
            if _PEER_UP in reasons:
                fast_until = trio.current_time() + window
            look = _LOOK in reasons or trio.current_time() >= max(start_until, fast_until)
            was_waiting = bool(waiting)
            try:
                if look or not waiting:
                    waiting = await _promote_learners(node, client)
                else:
                    waiting = await _promote(node, client, waiting)
            except EtcdUnavailable as e:
                # etcd went away under us (it exits by itself once its member
                # is removed): the consensus runnable deals with that and
                # stops this one; failing here would only log a second error.
                node.logger.info("cannot look for learners now: %s", e)
            now = trio.current_time()
            if _LOOK in reasons or (waiting and not was_waiting):
                start_until = now + window
            if not waiting:
                delay = config.promote_interval
            elif now < fast_until:
                delay = first_retry
            elif now < start_until:
                delay = heartbeat
            else:
                delay = min(delay * 1.5, config.promote_interval)


async def _promote(node: Node, client: Client, learners: set[int]) -> set[int]:
    """Try to promote each of ``learners``; return those etcd refused for now.

    A learner that etcd refuses for good (gone, or a voter already) is
    dropped: the next full look finds whatever there is to do.
    """
    left: set[int] = set()
    for member_id in sorted(learners):
        try:
            await client.member_promote(member_id)
        except EtcdAPIError as e:
            if e.transient:
                left.add(member_id)
            node.logger.debug("learner %x not promoted: %s", member_id, e.message)
        else:
            node.logger.info("promoted %x to voter", member_id)
    return left


async def _promote_learners(node: Node, client: Client) -> set[int]:
    """Promote the started learners if this member leads raft; the learners left waiting."""
    status = await client.status()
    if status.leader != status.member_id:
        return set()
    waiting: set[int] = set()
    for member in await client.member_list():
        if not member.is_learner:
            continue
        if not member.name:
            waiting.add(member.id)  # added, not started yet
            continue
        try:
            await client.member_promote(member.id)
        except EtcdAPIError as e:
            if not e.transient:
                raise
            waiting.add(member.id)
            node.logger.debug("learner %s not promotable yet: %s", member.name, e.message)
        else:
            node.logger.info("promoted %s (%x) to voter", member.name, member.id)
    return waiting


async def _sync_crl(node: Node, client: Client, path: Path) -> None:
    """Keep ``path`` equal to the CRL in etcd.

    etcd re-reads the CRL file for every new peer connection but never
    checks its signature, so only CRLs signed by the peer CA are written;
    anything else in etcd is logged and the last good list stays in force.
    """
    kv = client.namespaced(peerpki.NAMESPACE)
    ca = await peerpki.load_ca(kv)
    current = await kv.get(peerpki.KEY_CRL)
    if current is None:
        raise peerpki.PeerPKIError("no CRL in etcd")
    await _apply_crl(current.value, ca, path, node.logger)
    node.signal_healthy()
    async with kv.watch(peerpki.KEY_CRL, start_revision=current.mod_revision + 1) as watch:
        async for response in watch:
            for event in response.events:
                if event.type == "PUT":
                    await _apply_crl(event.kv.value, ca, path, node.logger)
                else:
                    node.logger.error("CRL deleted from etcd; keeping the last one")


async def _apply_crl(raw: bytes, ca: peerpki.PeerCA, path: Path, logger: logging.Logger) -> None:
    """Write ``raw`` to ``path`` if it is a CRL signed by ``ca``; log and keep the old one if not.

    The write (with fsync) runs in a worker thread; a cancellation waits for
    it, so the file is always the old or the new list.
    """
    try:
        crl = pki.decode_crl(raw)
        pki.verify_crl(crl, ca.certificate)
    except pki.PKIError as e:
        logger.error("ignoring bad CRL from etcd, keeping the last one: %s", e)
        return
    encoded = pki.encode_crl(crl)
    if _has_content(path, encoded):
        # Every start reads the CRL back from etcd, and it is usually the
        # one on disk: an fsync saved on the start path.
        return
    await trio.to_thread.run_sync(atomic_write, path, encoded)
    logger.info("CRL written (%d revoked)", len(list(crl)))
