"""The control-plane worker: runs this node's consensus and curator when it should.

Monogon's seed (``worker_controlplane.go``), reshaped for Trio::

    bootstrap data ─ map-bootstrap-data ─┐
    membership (home, credentials) ─ map ┼─▶ one memory channel ─▶ reduce ─▶ startup value
    node roles ─ map-roles ──────────────┘       (a group: they restart together)
                                                                  │
    launcher: watches the startup value; runs consensus + curator ◀┘
              inside a scope, which it leaves and re-enters (restart on
              request) only when changed() says the control plane
              appears or disappears, or the node's etcd member is a new
              one (after a recovery); publishes the local services in
              the membership (and after a bootstrap the node's first
              credentials, directory and roles).

Values in, decisions out: the launcher acts on the startup decision alone,
which holds what it needs (bootstrap data, or join data and credentials).
What it publishes in the membership is merged into the newest value
(:meth:`ControlPlaneWorker._publish`, through ``Value.update``: the
launcher never reads the membership) and never comes back as a decision:
the membership mapper forwards only a change of home or credentials. The
one output that does is the bootstrap's roles, by design: they turn the
decision from "bootstrap" into "join", which changed() does not act on.
Consensus calls nothing of this module: on a bootstrap it publishes the
curator's view of etcd (``Service.bootstrap_kv``), and the launcher creates
the cluster through it.

Bootstrap (as the seed, made restartable and pipelined around etcd's
start)::

    cluster CA and this node's certificate made (its credentials)
    consensus starts: peer PKI made, etcd spawned ──────────────┐
    etcd's server started, it waits for its first election:     │
      roles (this node's join data), directory, sealed          │
      configuration, owner certificate written, and the         │
      credentials staged, all fsynced; TLS contexts built       │
    etcd answers (bootstrap_kv): peer PKI, the cluster (curator  ◀┘
      state) and the curator's first lease, concurrently (one round
      trip); running
    credentials committed (a directory rename, fsynced); intent dropped
    curator started (it campaigns at once, on that lease)
    membership (home) and roles published

Every step is idempotent, and the credentials (which mean "done") become
the node's only after the cluster exists in etcd and every other file is
durable, so a crash anywhere resumes on the next start (staged credentials
mean nothing to ``disk.load``).

Bad join data in the roles is logged and skipped by ``reduce()``; nothing
here fails on it.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import trio
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from metropolis import consensus, identity, pki
from metropolis.consensus.client import KV, Lease
from metropolis.consensus.join import JoinCluster
from metropolis.crashpoint import CRASH_ENV, crash_point
from metropolis.curator.bootstrap import (
    BootstrapResult,
    bootstrap_roles,
    cluster_ca,
    create_cluster,
    node_certificate,
)
from metropolis.curator.service import Curator
from metropolis.curator.state import CuratorError
from metropolis.errors import ConsensusError
from metropolis.event import ReadOnlyValue, Value
from metropolis.identity import NodeCredentials
from metropolis.localstorage import Root
from metropolis.proto.common import (
    ClusterDirectory,
    ClusterDirectoryNode,
    ClusterDirectoryNodeAddress,
    NodeRoles,
)
from metropolis.proto.private import SealedConfiguration
from metropolis.roleserve import disk, recoverpending
from metropolis.roleserve.startup import (
    BootstrapControlPlane,
    BootstrapMessage,
    ControlPlaneStartup,
    JoinControlPlane,
    MembershipMessage,
    Message,
    NoControlPlane,
    ReduceState,
    RolesMessage,
    changed,
    reduce,
)
from metropolis.roleserve.values import BootstrapData, ClusterMembership, join_key_bytes
from metropolis.rpc import client_context, server_context
from metropolis.supervisor import Node, Scope

if TYPE_CHECKING:
    # Given only with --metrics-listen (a node without does not import
    # prometheus_client): named for types.
    from metropolis.rpc.metrics import RPCMetrics

__all__ = ["CRASH_ENV", "ControlPlaneWorker"]


class ControlPlaneWorker:
    """The worker; ``run`` is a supervisor runnable. See the module docstring.

    Inputs: ``bootstrap``, ``roles`` and (home, credentials) of
    ``membership``. Outputs: its fields of ``membership`` (local services;
    after a bootstrap the first credentials and directory) and, after a
    bootstrap, ``roles``. ``startup`` is its internal decision, exposed
    read-only for observers.
    """

    def __init__(
        self,
        *,
        root: Root,
        settings: disk.NodeSettings,
        bootstrap: ReadOnlyValue[BootstrapData],
        membership: Value[ClusterMembership],
        roles: Value[NodeRoles],
        rpc_metrics: RPCMetrics | None = None,
    ) -> None:
        """``rpc_metrics``: where the curator's API counts its calls."""
        self._root = root
        self._rpc_metrics = rpc_metrics
        #: The launcher's decisions so far: ``start`` (a control plane where
        #: there was none, or the first one), ``stop`` and ``restart`` (one
        #: control plane for another), for the node's metrics.
        self.decisions: dict[str, int] = {"start": 0, "stop": 0, "restart": 0}
        self._launched = False
        self._settings = settings
        self._bootstrap = bootstrap
        self._membership = membership
        self._roles = roles
        self._startup: Value[ControlPlaneStartup] = Value()
        self.startup = self._startup.readonly()

    async def run(self, node: Node) -> None:
        """Run the mappers, the reducer and the launcher until cancelled."""
        send, receive = trio.open_memory_channel[Message](0)

        async def map_bootstrap(n: Node) -> None:
            n.signal_healthy()
            with self._bootstrap.watch() as w:
                while True:
                    await send.send(BootstrapMessage(await w.get()))

        async def map_membership(n: Node) -> None:
            # Only what reduce() reads of the membership: that it is home,
            # with which credentials. The launcher's own outputs there (its
            # local services) and the directory's churn send nothing, so
            # what the launcher publishes never comes back to it.
            n.signal_healthy()
            sent: NodeCredentials | None = None
            with self._membership.watch() as w:
                while True:
                    m = await w.get(functools.partial(_home_with_new_credentials, sent))
                    sent = m.credentials
                    await send.send(MembershipMessage(m))

        async def map_roles(n: Node) -> None:
            n.signal_healthy()
            with self._roles.watch() as w:
                while True:
                    await send.send(RolesMessage(await w.get()))

        async def reducer(n: Node) -> None:
            n.signal_healthy()
            state = ReduceState()
            last: ControlPlaneStartup | None = None
            async for message in receive:
                decision = reduce(state, message)
                state = decision.state
                if decision.problem is not None:
                    n.logger.error("%s", decision.problem)
                startup = decision.startup
                if startup is not None and startup != last:
                    n.logger.info("control plane: %s", type(startup).__name__)
                    self._startup.set(startup)
                    last = startup

        # One channel between the members of one group: they restart together.
        node.run_group(
            {
                "map-bootstrap-data": map_bootstrap,
                "map-cluster-membership": map_membership,
                "map-roles": map_roles,
                "reduce": reducer,
            }
        )
        node.run("launcher", self._launcher)
        node.signal_healthy()
        await trio.sleep_forever()

    async def _launcher(self, node: Node) -> None:
        node.logger.info("waiting for start data")
        with self._startup.watch() as watcher:
            current = await watcher.get()
            if not self._launched:
                self._launched = True
                if not isinstance(current, NoControlPlane):
                    self.decisions["start"] += 1
            # Two scopes, so that the curator (inner) stops before the
            # consensus whose etcd client it uses (outer).
            async with node.scope() as outer, node.scope() as inner:
                if isinstance(current, NoControlPlane):
                    node.logger.info("no control plane on this node")
                    self._publish_without_control_plane()
                    await self._wipe_consensus_data(node)
                else:
                    await self._start(node, outer, inner, current)
                node.signal_healthy()
                while True:
                    new = await watcher.get()
                    if changed(current, new):
                        self.decisions[_decision(current, new)] += 1
                        node.restart(f"control plane changes: {type(new).__name__}")
                    current = new

    def _publish_without_control_plane(self) -> None:
        """Drop the local services from the membership, if it names them."""

        def without(m: ClusterMembership) -> ClusterMembership:
            if m.local_consensus or m.local_curator:
                return replace(m, local_consensus=None, local_curator=None)
            return m

        self._publish(without)

    def _publish(self, fields: Callable[[ClusterMembership], ClusterMembership]) -> None:
        """Publish the launcher's outputs in the membership: ``fields`` of the newest one.

        The membership has two writers: this launcher (the local services,
        and after a bootstrap the node's first credentials and directory)
        and the directory update (the directory). Each changes its own
        fields through `Value.update`, so neither loses what the other set,
        and neither reads the membership to do it: the launcher's inputs
        are its startup decisions alone, which come from ``reduce()``.
        The node sets a membership before the worker starts.
        """
        self._membership.update(fields)

    async def _wipe_consensus_data(self, node: Node) -> None:
        """Delete etcd's data: this node is no member (any more).

        A member removed from the cluster must not start from its old data
        (etcd would try to rejoin as the removed member); should it get the
        role again, it joins fresh from new join data.
        """
        etcd = self._root.data.etcd
        if etcd.data.exists() or etcd.peer_crl.exists():
            node.logger.info("not a consensus member: wiping etcd data")
            await trio.to_thread.run_sync(_remove_tree, etcd.path)
            await trio.to_thread.run_sync(self._root.create)  # the empty layout again

    async def _start(
        self,
        node: Node,
        outer: Scope,
        inner: Scope,
        startup: BootstrapControlPlane | JoinControlPlane,
    ) -> None:
        settings = self._settings
        creation: _ClusterCreation | None = None
        if isinstance(startup, BootstrapControlPlane):
            key = startup.data.node_private_key
            join = None
            creation = _ClusterCreation(startup.data, node, settings.curator_lease_ttl)
        else:
            key = startup.credentials.private_key
            join = startup.join
        config = settings.consensus_config(self._root, key, join)
        service = consensus.Service(config)
        node.logger.info("starting consensus and curator")
        outer.run("consensus", service.run)

        if creation is not None:
            credentials, directory, roles = await self._create_cluster(node, service, creation)
            # Last: the credentials mean "done" (disk.load), so they become
            # the node's only after the cluster exists in etcd and the other
            # files are durable; the node is home only once that is durable
            # too.
            if credentials is creation.credentials:
                # Staged and fsynced while etcd started: one rename and one
                # directory fsync, done here, blocking the event loop. A
                # worker thread would wait for the GIL before and after its
                # fsync, while the CRL watcher and promoter (which start as
                # consensus runs) keep this thread busy; nothing of this
                # node waits on the loop meanwhile but them.
                disk.save_credentials(self._root, credentials)
            else:  # another attempt's cluster won: staged and fsynced now
                await trio.to_thread.run_sync(disk.save_credentials, self._root, credentials)
                _warm_tls_contexts(credentials)
            node.logger.info("bootstrap complete: %s", credentials.node_id)
            # Only now: its campaign is an etcd write, and etcd's WAL fsync
            # beside the credentials' fsync makes both wait on the same
            # filesystem journal.
            curator = self._run_curator(inner, service, credentials, creation.lease)
            self._publish(
                lambda _: ClusterMembership(
                    public_key=credentials.public_key,
                    credentials=credentials,
                    remote_curators=directory,
                    local_consensus=service,
                    local_curator=curator,
                )
            )
            # The roles this bootstrap gave the node, as the role fetch
            # would publish them: reduce() then says "join" instead of
            # "bootstrap", which changed() does not act on.
            self._roles.set(roles)
        else:
            assert isinstance(startup, JoinControlPlane)
            joined = startup.credentials
            # A recovery whose restored etcd this curator prepares before
            # its first campaign (node recover left a mark beside the data).
            prepare = recoverpending.preparation(self._root, startup.join)
            running = self._run_curator(inner, service, joined, before_campaign=prepare)
            # This node's own entry added to the newest directory (the
            # directory update may have published one since the decision).
            self._publish(
                lambda m: replace(
                    m,
                    credentials=joined,
                    remote_curators=_with_node(
                        m.remote_curators or ClusterDirectory(),
                        joined.public_key,
                        settings.address,
                    ),
                    local_consensus=service,
                    local_curator=running,
                )
            )

    def _run_curator(
        self,
        inner: Scope,
        service: consensus.Service,
        credentials: NodeCredentials,
        lease: Lease | None = None,
        before_campaign: Callable[[consensus.Status], Awaitable[None]] | None = None,
    ) -> Curator:
        """Start this node's curator in ``inner`` (``lease``: for its first campaign;
        ``before_campaign``: see :class:`~metropolis.curator.service.Curator`)."""
        settings = self._settings
        curator = Curator(
            service.status,
            credentials.node_id,
            credentials=credentials,
            listen=(settings.address, settings.curator_port),
            peer_port=settings.peer_port,
            ttl=settings.curator_lease_ttl,
            heartbeat_timeout=settings.curator_heartbeat_timeout,
            lease=lease,
            rpc_metrics=self._rpc_metrics,
            before_campaign=before_campaign,
        )
        inner.run("curator", curator.run)
        return curator

    async def _create_cluster(
        self, node: Node, service: consensus.Service, creation: _ClusterCreation
    ) -> tuple[NodeCredentials, ClusterDirectory, NodeRoles]:
        """Create the cluster in etcd and write every file but the credentials.

        Pipelined, so that etcd's start is nearly all of it. While etcd
        waits for its first election, with this node's join data (known
        locally on a fresh bootstrap: ``Service.bootstrap_join``, given out
        then): its roles, directory, sealed
        configuration and the owner's certificate are written and fsynced,
        and the attempt's credentials staged (:func:`~.disk.save_credentials`
        makes them the node's) and their TLS contexts built.
        Once etcd answers, consensus hands the curator's keys out
        (``Service.bootstrap_kv``) while it stores its peer PKI, and
        :func:`_create_early` creates the cluster beside that store
        (:meth:`_ClusterCreation.in_etcd`): one round trip. Consensus calls
        nothing of this module; it publishes values that this worker acts
        on. Returns once etcd runs and both are done, with the credentials
        to save.

        Without local join data (a resumed bootstrap whose PKI etcd holds)
        or when that early creation did not happen or failed, it is done
        once consensus runs: join data asked from etcd, then
        :meth:`_ClusterCreation.create` (idempotent; its errors are raised here).
        The credentials returned are the attempt's (``creation.credentials``)
        unless etcd holds an earlier attempt's cluster.

        Crash safety: the files written here mean nothing to
        :func:`~.disk.load` without credentials, so writing them before the
        cluster exists is harmless; a retry that finds an earlier attempt's
        cluster in etcd rewrites them from what is stored.
        """
        data = creation.data
        directory = _with_node(ClusterDirectory(), data.node_public_key, self._settings.address)
        with service.bootstrap_join.watch() as watcher:
            join = await watcher.get()
        ca_key, ca, staged = creation.ca_key, creation.ca, creation.credentials
        async with trio.open_nursery() as nursery:
            if join is not None:
                planned_roles = bootstrap_roles(join)
                nursery.start_soon(
                    self._save_cluster_files, data, ca, ca_key, planned_roles, directory, staged
                )
            node.logger.info("bootstrapping: waiting for consensus")
            status = await _create_early(service, creation, join)
            result = creation.result
            if result is None:
                node.logger.info("bootstrapping: creating the cluster")
                if join is None:
                    join = await status.add_node(data.node_public_key)
                    planned_roles = bootstrap_roles(join)
                    nursery.start_soon(
                        self._save_cluster_files, data, ca, ca_key, planned_roles, directory, staged
                    )
                result = await creation.create(status.curator_client(), join)
        node.logger.info("bootstrapping: cluster created in etcd; saving credentials")
        roles = result.record.roles or NodeRoles()
        credentials = staged
        if result.ca_certificate != ca or roles != planned_roles:
            node.logger.info("bootstrapping: etcd holds an earlier attempt's cluster; using it")
            await self._save_cluster_files(
                data, result.ca_certificate, result.ca_key, roles, directory
            )
            credentials = NodeCredentials(
                data.node_private_key, result.node_certificate, result.ca_certificate
            )
        crash_point("after-bootstrap-cluster")
        return credentials, directory, roles

    async def _save_cluster_files(
        self,
        data: BootstrapData,
        ca: x509.Certificate,
        ca_key: Ed25519PrivateKey,
        roles: NodeRoles,
        directory: ClusterDirectory,
        staged: NodeCredentials | None = None,
    ) -> None:
        """Write and fsync the cluster files (in a worker thread), ``staged`` credentials too.

        Staged credentials get their TLS contexts built afterwards, on this
        thread: on a fresh bootstrap this runs while etcd waits for its
        first election, so that costs no time on the critical path, and the
        node's services find them ready as it comes home.
        """
        sealed = SealedConfiguration(
            node_unlock_key=data.node_unlock_key,
            join_key=join_key_bytes(data.join_private_key),
            cluster_ca=pki.encode_certificate(ca, pki.Encoding.DER),
        )
        owner = pki.issue_certificate(
            ca_key,
            ca,
            pki.decode_public_key(data.initial_owner_key),
            identity.OWNER_COMMON_NAME,
            pki.Usage.CLIENT,
        )
        await trio.to_thread.run_sync(
            functools.partial(
                disk.save_cluster_files,
                self._root,
                self._settings,
                roles=roles,
                directory=directory,
                sealed=sealed,
                # For the owner CLI in this root, saving it an escrow
                # (AAA.Escrow, metropolis.curator.aaa), which every other
                # root and the cluster file need. It is public data.
                owner_certificate=pki.encode_certificate(owner),
                staged_credentials=staged,
            )
        )
        if staged is not None:
            _warm_tls_contexts(staged)


def _warm_tls_contexts(credentials: NodeCredentials) -> None:
    """Build the TLS contexts this node's services will ask for (rpc.tls keeps them).

    Its curator, debug service, role fetch, directory and status push all
    start as it comes home, each asking for one of these two contexts
    (built on the Trio thread, while the new curator campaigns); built
    before, they cost nothing then.
    """
    server_context(credentials)
    client_context(credentials.ca_certificate, credentials.certificate, credentials.private_key)


async def _create_early(
    service: consensus.Service, creation: _ClusterCreation, join: JoinCluster | None
) -> consensus.Status:
    """Wait for consensus to run; with ``join``, create the cluster as soon as etcd answers.

    ``join`` is this run's own join data (``Service.bootstrap_join``), given
    only on a run that stores the bootstrap PKI, which hands the curator's
    keys out (``Service.bootstrap_kv``) before it says running. If that is
    missed (consensus restarted in between), nothing is created early and
    the caller creates the cluster once consensus runs. An early creation
    that began is waited for; it never raises (see
    :meth:`_ClusterCreation.in_etcd`).
    """
    waiting = trio.CancelScope()

    async def early(join: JoinCluster) -> None:
        kv: KV | None = None
        with waiting, service.bootstrap_kv.watch() as watcher:
            kv = await watcher.get(lambda kv: kv is not None)
        if kv is not None:
            await creation.in_etcd(kv, join)

    async with trio.open_nursery() as nursery:
        if join is not None:
            nursery.start_soon(early, join)
        status = await service.wait_running()
        waiting.cancel()
    return status


def _decision(current: ControlPlaneStartup, new: ControlPlaneStartup) -> str:
    """What the launcher does when ``changed(current, new)``: start, stop or restart."""
    if isinstance(current, NoControlPlane):
        return "start"
    return "stop" if isinstance(new, NoControlPlane) else "restart"


def _home_with_new_credentials(sent: NodeCredentials | None, m: ClusterMembership) -> bool:
    return m.home and m.credentials != sent


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _with_node(directory: ClusterDirectory, public_key: bytes, host: str) -> ClusterDirectory:
    """``directory`` with this node in it (added once, reachable at ``host``)."""
    if any(n.public_key == public_key for n in directory.nodes):
        return directory
    node = ClusterDirectoryNode(
        public_key=public_key, addresses=[ClusterDirectoryNodeAddress(host=host)]
    )
    return ClusterDirectory(nodes=[*directory.nodes, node])


class _ClusterCreation:
    """One bootstrap attempt: its cluster CA and, once created in etcd early, the result."""

    def __init__(self, data: BootstrapData, node: Node, lease_ttl: int) -> None:
        self.data = data
        self._lease_ttl = lease_ttl
        self._logger = node.logger
        self.result: BootstrapResult | None = None
        #: A lease for the curator's first campaign, granted in the same round trip.
        self.lease: Lease | None = None

    @functools.cached_property
    def _made(self) -> tuple[Ed25519PrivateKey, x509.Certificate, NodeCredentials]:
        # Made at first use, not before etcd is spawned (it costs CPU):
        # the files written while etcd waits for its election and the hook
        # below are the first to need them.
        ca_key, ca = cluster_ca()
        certificate = node_certificate(ca_key, ca, self.data.node_public_key)
        return ca_key, ca, NodeCredentials(self.data.node_private_key, certificate, ca)

    @property
    def ca_key(self) -> Ed25519PrivateKey:
        """This attempt's cluster CA key."""
        return self._made[0]

    @property
    def ca(self) -> x509.Certificate:
        """This attempt's cluster CA certificate."""
        return self._made[1]

    @property
    def credentials(self) -> NodeCredentials:
        """This attempt's credentials, staged on disk while etcd starts."""
        return self._made[2]

    async def in_etcd(self, kv: KV, join: JoinCluster) -> None:
        """Create the cluster through ``kv`` (``Service.bootstrap_kv``) beside the PKI store.

        Also grants the curator's first lease (etcd commits the three writes
        together): it campaigns one round trip sooner. Never raises etcd's or
        the curator's errors: consensus must not fail for them. The launcher
        then tries again once consensus runs, and raises what that meets (and
        the curator grants its own lease).
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._create, kv, join)
            nursery.start_soon(self._grant, kv)

    async def _grant(self, kv: KV) -> None:
        try:
            self.lease = await kv.grant(self._lease_ttl)
        except ConsensusError as e:
            self._logger.info("bootstrapping: no early lease (%s)", e)

    async def create(self, kv: KV, join: JoinCluster) -> BootstrapResult:
        """Create this attempt's cluster in etcd (idempotent: see
        :func:`~metropolis.curator.bootstrap.create_cluster`, whose errors it raises)."""
        data = self.data
        return await create_cluster(
            kv,
            node_public_key=data.node_public_key,
            join_public_key=data.join_public_key,
            cluster_unlock_key=data.cluster_unlock_key,
            owner_public_key=data.initial_owner_key,
            join=join,
            ca=(self.ca_key, self.ca),
            certificate=self.credentials.certificate,
        )

    async def _create(self, kv: KV, join: JoinCluster) -> None:
        try:
            self.result = await self.create(kv, join)
        except (CuratorError, ConsensusError) as e:
            self._logger.info("bootstrapping: cluster not created early (%s); retrying", e)
