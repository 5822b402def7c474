"""One curator's RPC server: both APIs, the security hooks, and what runs beside them.

::

    CuratorServer.load ── reads owner key, CA and CRL once
      ├── NodeAPI        (:mod:`.nodeapi`)        what nodes call
      ├── ManagementAPI  (:mod:`.managementapi`)  what the owner calls
      │     ├── Membership (:mod:`.membership`)   ConsensusMember grants, revokes
      │     └── Deletion   (:mod:`.deletion`)     DeleteNode: member, record, CRL
      ├── Escrow         (:mod:`.aaa`)            the owner's certificate, for its key
      ├── Removals       (:mod:`.removal`)        the next leader's half of a removal
      ├── Rejoins        (:mod:`.rejoin`)         members added again after a recovery
      └── Records        (:mod:`.records`)        leader-guarded reads and writes
    serve: the RPC server, and beside it the election's follower, the CRL's
           follower, the removals and the rejoins of each term; until cancelled

The security hooks (:meth:`CuratorServer.security`) answer from memory: the
owner key and CA are fixed at bootstrap and read once, the CRL is re-read
after every revocation and on start (:meth:`CuratorServer.follow_crl`), and
leadership is the last value of the election. The cluster CRL
(``CRL_KEY``) is followed for the security hook; a deletion
(:mod:`.deletion`) writes it, and sets this curator's copy at once.

A follower's UNAVAILABLE names the leader's node ID and, from the leader's
reported status, its curator's ``host:port``: a client whose directory
predates that curator goes there.
"""

from __future__ import annotations

import logging
import random

import trio
from cryptography import x509

from metropolis import pki
from metropolis.consensus import Status as ConsensusStatus
from metropolis.consensus.client import EtcdError, Get, RangeResult
from metropolis.curator.aaa import Escrow
from metropolis.curator.deletion import Deletion
from metropolis.curator.election import ElectionState, Follower, Leader
from metropolis.curator.managementapi import HEARTBEAT_TIMEOUT, ManagementAPI
from metropolis.curator.membership import LEARNER_TIMEOUT, Membership
from metropolis.curator.nodeapi import NodeAPI
from metropolis.curator.records import Records
from metropolis.curator.rejoin import Rejoins
from metropolis.curator.removal import Removals
from metropolis.curator.state import CA_CERTIFICATE_KEY, CRL_KEY, INITIAL_OWNER_KEY, CuratorError
from metropolis.event import ReadOnlyValue
from metropolis.proto.curator import InitialOwner
from metropolis.rpc import LeaderHint, Leadership, Server, ServerSecurity

__all__ = ["CuratorServer"]

_log = logging.getLogger("metropolis.curator.server")


class CuratorServer:
    """Handlers and security hooks for one curator's RPC server.

    Build with :meth:`load` once consensus runs; :meth:`register` the
    handlers with a server and :meth:`serve` it. ``rng`` draws the jitter
    of the removals' retries.
    """

    def __init__(
        self,
        consensus: ConsensusStatus,
        *,
        owner_key: bytes,
        ca: x509.Certificate,
        crl: x509.CertificateRevocationList | None,
        peer_port: int = 7834,
        learner_timeout: float = LEARNER_TIMEOUT,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
        rng: random.Random | None = None,
    ) -> None:
        self._records = Records(consensus.curator_client())
        # One membership change at a time from this curator (removals too).
        lock = trio.Lock()
        self.removals = Removals(self._records, consensus, lock, rng=rng)
        membership = Membership(
            self._records,
            consensus,
            self.removals,
            lock,
            peer_port=peer_port,
            learner_timeout=learner_timeout,
        )
        self.rejoins = Rejoins(self._records, consensus, membership, peer_port=peer_port, rng=rng)
        self.nodes = NodeAPI(self._records, consensus, ca=ca, peer_port=peer_port)
        deletion = Deletion(
            self._records,
            consensus,
            membership,
            ca=ca,
            peer_port=peer_port,
            crl_changed=self._set_crl,
        )
        self.management = ManagementAPI(
            self._records,
            membership,
            deletion,
            consensus,
            ca=ca,
            peer_port=peer_port,
            heartbeat_timeout=heartbeat_timeout,
        )
        self.escrow = Escrow(self._records.kv, ca=ca, owner_key=owner_key)
        self._owner_key = owner_key
        self._ca = ca
        self._crl = crl
        #: The leading curator's host:port when following (for the hint).
        self._leader_address = ""

    @classmethod
    async def load(
        cls,
        consensus: ConsensusStatus,
        *,
        peer_port: int = 7834,
        learner_timeout: float = LEARNER_TIMEOUT,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
    ) -> CuratorServer:
        """Read owner key, CA and CRL; :class:`CuratorError` if the cluster is missing.

        ``consensus`` must be running (its etcd client is used for every call).

        Serializable reads, answered by this node's etcd member alone: the
        owner key and the CA never change once the cluster exists, and the
        CRL is a cache that :meth:`follow_crl` keeps current (its first
        read is linearizable), as it would have to after a linearizable
        read too. On a node that has just joined, a linearizable read would
        wait for the leader to confirm it still leads (a round of
        heartbeats), on the grant of ConsensusMember's critical path.
        """
        kv = consensus.curator_client()
        keys = (INITIAL_OWNER_KEY, CA_CERTIFICATE_KEY, CRL_KEY)
        result = await kv.txn([], [Get(k, serializable=True) for k in keys], [])
        owner, ca, crl = (r for r in result.responses if isinstance(r, RangeResult))
        if not owner.kvs or not ca.kvs:
            raise CuratorError("no cluster in etcd (owner or CA missing)")
        try:
            return cls(
                consensus,
                peer_port=peer_port,
                learner_timeout=learner_timeout,
                heartbeat_timeout=heartbeat_timeout,
                owner_key=InitialOwner.parse(owner.kvs[0].value).public_key,
                ca=pki.decode_certificate(ca.kvs[0].value),
                crl=pki.decode_crl(crl.kvs[0].value) if crl.kvs else None,
            )
        except pki.PKIError as e:
            raise CuratorError(f"cluster PKI in etcd is damaged: {e}") from e

    # --- security hooks ---------------------------------------------------

    def security(self) -> ServerSecurity:
        return ServerSecurity(
            owner_key=lambda: self._owner_key,
            crl=lambda: self._crl,
            leadership=self._leadership,
        )

    def _set_crl(self, crl: x509.CertificateRevocationList) -> None:
        """Cache ``crl`` unless the cached one is newer (a deletion sets it before the watch)."""
        if self._crl is None or pki.crl_number(crl) >= pki.crl_number(self._crl):
            self._crl = crl

    def _leadership(self) -> Leadership:
        state = self._records.election
        if isinstance(state, Leader):
            return Leadership(True)
        if state is None or state.leader is None:
            return Leadership(False)
        return Leadership(False, LeaderHint(state.leader.node_id, self._leader_address))

    async def follow_election(self, election: ReadOnlyValue[ElectionState]) -> None:
        """Keep ``leadership()`` at the election's latest state; runs until cancelled."""
        with election.watch() as watcher:
            while True:
                self._records.election = state = await watcher.get()
                self._leader_address = ""
                if isinstance(state, Follower) and state.leader is not None:
                    self._leader_address = await self._curator_address(state.leader.node_id)

    async def _curator_address(self, node_id: str) -> str:
        """``host:port`` of the curator on ``node_id`` as its status says; "" if unknown.

        Sent with UNAVAILABLE, it lets a client whose directory predates
        that curator reach the leader.
        """
        try:
            found = await self._records.read(node_id)
        except (CuratorError, EtcdError) as e:
            _log.info("leader's address unknown: %s", e)
            return ""
        status = found[0].status if found is not None else None
        if status is None or not status.external_address or status.running_curator is None:
            return ""
        host = status.external_address
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{status.running_curator.port}"

    async def follow_crl(self) -> None:
        """Keep the cached CRL at etcd's (other curators revoke too); runs until cancelled."""
        kv = self._records.kv
        first = await kv.range(CRL_KEY)
        if first.kvs:
            self._take_crl(first.kvs[0].value)
        async with kv.watch(CRL_KEY, start_revision=first.revision + 1) as watch:
            async for response in watch:
                for event in response.events:
                    if event.type == "PUT":
                        self._take_crl(event.kv.value)

    def _take_crl(self, raw: bytes) -> None:
        """Cache the CRL ``raw``, unless damaged, not the CA's, or older than the cached one."""
        try:
            crl = pki.decode_crl(raw)
            pki.verify_crl(crl, self._ca)
        except pki.PKIError as e:
            _log.error("ignoring a bad CRL: %s", e)
            return
        self._set_crl(crl)

    # --- wiring ----------------------------------------------------------

    def register(self, server: Server) -> None:
        """Register every handler of both APIs with ``server``."""
        self.nodes.register(server)
        self.management.register(server)
        self.escrow.register(server)

    async def serve(
        self,
        server: Server,
        election: ReadOnlyValue[ElectionState],
        listeners: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Follow the election and serve on ``listeners`` until cancelled; reports the port."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.follow_election, election)
            nursery.start_soon(self.follow_crl)
            nursery.start_soon(self.removals.run, election)
            nursery.start_soon(self.rejoins.run, election)
            task_status.started(await nursery.start(server.serve_listeners, listeners))
