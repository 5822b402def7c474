"""Membership operations on a running member: :class:`Status` adds and removes nodes.

``Service.status`` publishes a :class:`Status`; while it says running, its
methods talk to the local etcd member. Adding a node issues its peer
certificate and adds it as a learner (the promoter makes it a voter);
removing one removes its member and revokes its certificate. etcd refuses
membership changes for a while after one; those refusals are retried
(through :mod:`common.backoff`) for ``Config.membership_timeout``.
"""

from __future__ import annotations

import ipaddress
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import urlsplit

import trio
from cryptography import x509

from common.backoff import ExponentialBackoff, Retrier
from common.durable import atomic_write
from metropolis import identity, pki
from metropolis.consensus import peerpki
from metropolis.consensus.client import GRPC_NOT_FOUND, KV, Client, EtcdAPIError, Member
from metropolis.consensus.config import CURATOR_NAMESPACE, Config
from metropolis.consensus.join import ExistingNode, JoinCluster
from metropolis.consensus.promoter import LOOK, Nudge
from metropolis.errors import ConsensusError
from metropolis.gather import gather

__all__ = ["NotRunning", "Status"]

_T = TypeVar("_T")


class NotRunning(ConsensusError):
    """The local etcd member is not running (yet, or any more)."""


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
    _nudge: Nudge | None = field(default=None, repr=False, compare=False)

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
            member, after = await _add_learner(
                client, peer_url, config.membership_timeout, config.rng
            )
            logging.getLogger("metropolis.consensus").info(
                "added %s (%s) as learner %x", node, peer_url, member.id
            )
            if self._nudge is not None:
                self._nudge.set(LOOK)
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
                await _remove_member(client, member.id, config.membership_timeout, config.rng)
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


#: Between two tries of a membership change etcd refused for now: etcd
#: refuses them for a few seconds after one (its member health window), so
#: the waits grow towards a second; jittered, since members' curators may
#: retry changes at the same time.
MEMBERSHIP_BACKOFF = ExponentialBackoff(
    initial=0.25, maximum=1.0, multiplier=1.5, jitter=(0.75, 1.25)
)


async def _retry_transient(
    fn: Callable[[], Awaitable[_T]],
    patience: float,
    rng: random.Random,
    *,
    applied: Callable[[], Awaitable[_T | None]],
) -> _T:
    """Call ``fn`` until etcd stops refusing it transiently, for at most ``patience`` s.

    Waits between tries follow :data:`MEMBERSHIP_BACKOFF`, jittered by ``rng``.

    A membership change refused transiently may still have applied (it
    timed out, see :data:`~.client.MEMBERSHIP_DEADLINE`), and a repeated
    one would then fail (a member added twice, removed twice). So before
    each retry ``applied()`` looks: what it returns, if not None, is the
    change's result.
    """
    last: EtcdAPIError | None = None
    retrier = Retrier(MEMBERSHIP_BACKOFF, rng)
    with trio.move_on_after(patience):
        while True:
            try:
                return await fn()
            except EtcdAPIError as e:
                if not e.transient:
                    raise
                last = e
            await retrier.sleep()
            if (result := await applied()) is not None:
                return result
    raise ConsensusError(f"etcd kept refusing the membership change for {patience}s: {last}")


async def _add_learner(
    client: Client, peer_url: str, patience: float, rng: random.Random
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
        lambda: client.member_add_listing([peer_url], learner=True),
        patience,
        rng,
        applied=applied,
    )


async def _remove_member(
    client: Client, member_id: int, patience: float, rng: random.Random
) -> None:
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

    await _retry_transient(remove, patience, rng, applied=applied)
