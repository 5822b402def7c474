"""Promotion of learners: the leader's promoter, and a learner's wait to be a voter.

A node joins as a non-voting learner (``Status.add_node``); etcd makes it a
voter only when asked, once it has caught up. :func:`run_promoter` asks, on
the raft leader; :func:`wait_voter` is the learner's own wait for it.
:class:`Nudge` wakes either when something happened that makes a promotion
likely (a learner added, a peer's stream up, a promotion applied).
"""

from __future__ import annotations

import logging

import trio

from metropolis.consensus import peerpki
from metropolis.consensus.client import Client, EtcdAPIError, EtcdUnavailable
from metropolis.consensus.config import Config
from metropolis.consensus.process import Tuning
from metropolis.supervisor import Node

__all__ = ["LOOK", "PEER_UP", "Nudge", "run_promoter", "wait_voter"]


class Nudge:
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
LOOK = "look"
#: Why the promoter is nudged: etcd logged that a stream to a peer came up,
#: so a learner that waits may now catch up.
PEER_UP = "peer up"


async def wait_voter(
    client: Client, tuning: Tuning, logger: logging.Logger, promoted: Nudge
) -> None:
    """Wait until this member is a voter (learners are promoted by the leader).

    etcd 3.4's status says whether the member behind the socket is a
    learner; a learner cannot watch anything, so this looks: one small call
    on our own socket, at once when ``promoted`` is set (etcd logged that
    it applied a promotion, see :func:`~.process.run_etcd`), and in any
    case every quarter heartbeat for ten election timeouts (the leader
    promotes a learner within a few heartbeats of it catching up, which it
    has once its client socket answers), then every heartbeat. Looking only
    on the timer would put an eighth of a heartbeat on average on the
    critical path of a grant of ConsensusMember.
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


async def run_promoter(node: Node, client: Client, config: Config, nudge: Nudge) -> None:
    """On the raft leader, promote every started learner; etcd refuses those not caught up.

    Only the leader acts, so members do not all hammer etcd with the same
    promotions; if leadership moves in between, a promotion is merely
    refused or repeated, both harmless.

    When it looks. etcd tells nobody when a learner has caught up (about
    when its client socket answers), so a waiting learner is polled, and
    the promotion comes on average half a retry after it could: on the
    critical path of a grant of ConsensusMember. But a learner cannot catch
    up before its etcd connects to the leader, and the leader's etcd logs
    when a peer's stream comes up (``nudge`` gets :data:`PEER_UP`):

    - at once when a learner may be coming (``add_node`` on this node
      nudges with :data:`LOOK`; on any node, ``add_node`` issues the peer
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

    Why the two rates. A refused promotion is one small call (CPU of this
    thread and of the leader's etcd), and on a grant it runs beside the
    learner's etcd starting up on the same cores: polling every quarter
    heartbeat from the member add on would make many calls before the
    learner has even connected. Once it has, a full heartbeat between
    tries would make the promotion half a heartbeat late on average,
    on the grant's critical path; a quarter heartbeat keeps that small.

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
                nudge.set(LOOK)

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
            if PEER_UP in reasons:
                fast_until = trio.current_time() + window
            look = LOOK in reasons or trio.current_time() >= max(start_until, fast_until)
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
            if LOOK in reasons or (waiting and not was_waiting):
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
