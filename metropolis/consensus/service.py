"""The consensus service: this node's etcd member, run under the supervisor.

Startup decides where the peer TLS material comes from::

    JoinCluster given? ──yes──> etcd data beside another peer cert: deleted (a new member)
          │ no                  write CA, peer cert, our key, CRL to data/etcd
          │                     start etcd as a member of the existing cluster
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
etcd once (not twice, first with plain-HTTP peers). A crash anywhere in
between resumes: while the CA key file exists, the PKI is not in etcd yet;
if etcd never ran, everything is made anew.

While the CA key file exists nobody can have joined either, so this node's
own join data is known before etcd starts (``Service.bootstrap_join``, given
out once etcd's server has started: the caller writes its files while etcd
waits for its first election). Once etcd answers, the service hands the
curator's view of etcd out (``Service.bootstrap_kv``) while it stores the
PKI, so that the caller's first writes (the curator's cluster) can go to
etcd beside that store, in the same round trip. The service calls nothing
of its caller: it publishes values, and the caller decides what to do
with them. The PKI's fsync waits for etcd's server start too: work beside
etcd's own start-up competes with it for the cores and the disk.

Once etcd answers and this member is a voter, two children run beside it,
in a supervisor scope that ends before the etcd client they use is closed::

    consensus ──┬── etcd process (removal.EtcdUntilRemoved; its log under "<name>.etcd")
                └── scope ──┬── promoter (promoter.run_promoter): caught-up learners become voters
                            └── crl (crlsync.sync_crl): etcd's CRL key ──watch──> peer_crl.pem

and ``status`` (a read-only view of a :class:`~.membership.Status`) says
running. If etcd dies, the runnable fails and the supervisor restarts it,
on the same data; but when etcd exits
by itself because its member was removed from the cluster (status 0, or
etcd's known panic in that moment: see :mod:`.removal`) the runnable logs
one WARNING and waits, status not running, to be stopped or restarted by
its owner when the node's roles change. When the runnable
ends for any reason, ``status`` goes back to not running and the children
are stopped, then the client is closed, and the etcd process is stopped
before ``run`` returns.

Files are written with fsync (``atomic_write``) in a worker thread, so a slow
disk does not stall the other tasks of the node.
"""

from __future__ import annotations

import logging
import shutil
from functools import partial
from pathlib import Path
from typing import TypeVar

import trio
from cryptography import x509

from common.durable import atomic_write, make_durable
from metropolis import identity, pki
from metropolis.consensus import peerpki
from metropolis.consensus.child import stop_ahead
from metropolis.consensus.client import KV, Client, EndpointStatus
from metropolis.consensus.config import CURATOR_NAMESPACE, Config
from metropolis.consensus.crlsync import has_content, sync_crl
from metropolis.consensus.join import JoinCluster
from metropolis.consensus.membership import Status
from metropolis.consensus.peerhosts import peer_hosts
from metropolis.consensus.promoter import PEER_UP, Nudge, run_promoter, wait_voter
from metropolis.consensus.removal import EtcdUntilRemoved
from metropolis.errors import ConsensusError
from metropolis.event import ReadOnlyValue, Value
from metropolis.supervisor import Node

__all__ = ["Service"]

_T = TypeVar("_T")

#: The new peer CA's key, on disk only from bootstrap until etcd stores it.
_PENDING_CA_KEY = "bootstrap_ca_key.pem"


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
        self._bootstrap_kv: Value[KV | None] = Value()
        self._bootstrap_kv_view = self._bootstrap_kv.readonly()

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

    @property
    def bootstrap_kv(self) -> ReadOnlyValue[KV | None]:
        """The curator's view of etcd on a bootstrap, from the moment etcd answers.

        Set by each ``run``: None at its start and end; on a run that stores
        the bootstrap PKI in etcd (one that sets ``bootstrap_join``), the
        curator's keys (``namespaced/curator/``) as soon as etcd first
        answers and the PKI files are durable, while that store is in
        flight and before ``status`` says running. The bootstrapping node
        writes its cluster's first curator state through it, beside the
        PKI store (etcd commits concurrent writes with one WAL fsync).
        Calls through it fail with
        :class:`~metropolis.consensus.client.EtcdUnavailable` once the run
        ends. A caller that misses it (the run restarted) waits for
        ``status`` to say running instead.
        """
        return self._bootstrap_kv_view

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
        self._bootstrap_kv.set(None)
        try:
            await self._run(node)
        finally:
            self._status.set(self._stopped())
            self._bootstrap_kv.set(None)

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
            await self._drop_other_members_data(node, join)
            unsynced = await self._write_join_pki(join)
            store_pki = False
            process = config.joining_process()
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
            # for its first election: beside etcd's own start up to there
            # they would compete with it for the cores and the disk.
            server_started = trio.Event()
            gate = server_started if store_pki else None
            nursery.start_soon(_make_durable, unsynced, synced, gate)
            if bootstrap_join is not None:
                nursery.start_soon(_set_after, server_started, self._bootstrap_join, bootstrap_join)
            removed = EtcdUntilRemoved()
            promoted = Nudge()
            # The promoter's: it starts once this member votes, but a learner's
            # stream may come up at any time.
            nudge = Nudge()
            first: EndpointStatus = await nursery.start(
                removed.run_etcd,
                process,
                etcd_logger,
                nursery.cancel_scope,
                server_started,
                promoted.set,
                partial(nudge.set, PEER_UP),
            )
            removed.ready = True
            # Nothing goes into etcd before the PKI files are durable: a power
            # cut must not leave etcd with a PKI (or curator state naming it)
            # that this node's disk lost.
            await synced.wait()
            if bootstrap_pki is not None:
                # Before the store: the caller's first writes go beside it.
                self._bootstrap_kv.set(client.namespaced(CURATOR_NAMESPACE))
                await self._store_bootstrap_pki(node, client, bootstrap_pki)
            member_id = first.member_id
            if first.is_learner:
                await wait_voter(client, config.tuning, node.logger, promoted)

            # The children borrow the client: the scope ends them before the
            # client is closed. It is left when run_etcd raises EtcdExited
            # (which cancels this block) or when we are cancelled.
            async with node.scope() as sub:
                sub.run("promoter", lambda n: run_promoter(n, client, config, nudge))
                sub.run("crl", lambda n: sync_crl(n, client, config.data.peer_crl))
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
            # nursery; see EtcdUntilRemoved). Restarting
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
        if not all(has_content(path, data) for path, data in files.items()):
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

    async def _drop_other_members_data(self, node: Node, join: JoinCluster) -> None:
        """Delete etcd's data if it is of a member the join data's is not.

        The curator issues a node a new peer certificate only when it adds
        the node as a new member (after a recovery from a snapshot dropped
        the old one: :mod:`metropolis.curator.rejoin`); etcd data beside
        another certificate is the old member's, of a cluster that no
        longer knows it, and etcd would only fail on it. Unreadable or
        absent certificates are left to the checks that follow.
        """
        data = self.config.data
        if not (data.data / "member").exists():
            return
        try:
            on_disk = pki.decode_certificate(data.peer_pki.certificate.read_bytes())
        except (OSError, pki.PKIError):
            return
        if on_disk == join.node_certificate:
            return
        node.logger.warning(
            "join data for a new member (a new peer certificate): deleting the old"
            " member's etcd data in %s",
            data.data,
        )
        # Not under a running etcd (one started ahead would run on it).
        await trio.to_thread.run_sync(stop_ahead)
        await trio.to_thread.run_sync(shutil.rmtree, data.data)

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
        certificate = peerpki.issue_local_certificate(ca, own_key, peer_hosts(config.peer_address))

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
        # Not read back from disk: these are the files' contents, and the
        # moment etcd first answers is the busiest of this thread.
        ca, crl, certificate = made
        await peerpki.store_bootstrap(client.namespaced(peerpki.NAMESPACE), ca, crl, certificate)
        pending.unlink()
        node.logger.info("bootstrap peer PKI stored in etcd")


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
