"""Joining a cluster as a new node: register with a ticket, wait for approval, commit.

Monogon's ``cluster_register.go``, on Trio::

    intent saved: node key, join key, unlock keys, ticket, cluster (disk)
    RegisterNode(ticket, join key)     proof of possession of the node key
    CommitNode(cluster unlock key)     repeated until the owner approved (FAILED_PRECONDITION)
    -> node certificate: saved with directory, sealed configuration; intent removed

The node has no cluster certificate yet, so it calls with a proof of
possession (:mod:`metropolis.rpc.auth`) instead of Monogon's self-signed
ephemeral certificate. The cluster's CA and directory come from the owner
(``owner info --out FILE``: a ``GetClusterInfoResponse``).

Crash safety: the keys are on disk (:func:`~.disk.save_register_intent`)
before the cluster hears of them, and RegisterNode and CommitNode are
idempotent for the same keys, so :func:`register` simply runs again from
the saved intent after a crash or a cancellation at any point; the node
keeps the identity the cluster knows it by.

Retries: the same idempotence makes a call that found no curator (or
broke) safe to repeat, so UNAVAILABLE and DEADLINE_EXCEEDED (a curator not
up yet, a leader being elected, a loaded machine's 5 s connect timeout)
are retried, before registering and while waiting for approval, with
waits from `REGISTER_BACKOFF`, each retry logged. ``deadline`` bounds an
outage: once no curator has answered for that many seconds in a row, an
`RPCError` with the last error's status, saying so, is raised. Any answer
("not approved yet" too) ends the outage; the wait for the owner's
approval itself is not bounded.

Errors: :class:`~metropolis.rpc.RPCError` for a final refusal (a wrong
ticket is PERMISSION_DENIED; every status other than UNAVAILABLE,
DEADLINE_EXCEEDED and "not approved yet" ends it at once) and for an
outage past ``deadline``; :class:`~metropolis.roleserve.disk.NodeRootError`
for a bad cluster file. Cancellation stops it at any point (see above).
"""

from __future__ import annotations

import functools
import logging
import math
import random
from typing import TypeVar

import trio

from common.backoff import ExponentialBackoff, Retrier
from metropolis import identity, pki
from metropolis.crashpoint import crash_point
from metropolis.identity import NodeCredentials
from metropolis.localstorage import Root
from metropolis.proto import curator_api as c
from metropolis.proto.common import NodeRoles
from metropolis.proto.private import SealedConfiguration
from metropolis.roleserve import disk
from metropolis.roleserve.values import RegisterIntent, join_key_bytes
from metropolis.rpc import (
    Client,
    RPCError,
    Status,
    client_context,
    endpoints_from_directory,
    methods,
    open_client,
)
from metropolis.rpc.method import Message, Method

__all__ = ["APPROVAL_POLL", "DEFAULT_DEADLINE", "REGISTER_BACKOFF", "approval_asks", "register"]

_log = logging.getLogger("metropolis.roleserve.register")

#: Seconds without an answer from any curator before registration gives up
#: (``node register --register-deadline``).
DEFAULT_DEADLINE = 300.0

#: Waits between calls that found no curator. Jittered: nodes installed
#: together, waiting for the same curator, do not retry in step.
REGISTER_BACKOFF = ExponentialBackoff(initial=0.5, maximum=10.0, jitter=(0.75, 1.25))

#: Seconds before the first ask whether the owner approved, doubling up to
#: ``poll``: an approver that acts on its agent's report approves within
#: about a second of the node's registering, and a fixed second between
#: asks cost half a second of each install on average; a node left to a
#: person asks once a ``poll`` after its first few seconds.
APPROVAL_POLL = 0.1


def approval_asks(poll: float) -> ExponentialBackoff:
    """The waits between asks whether the owner approved: `APPROVAL_POLL`
    first (``poll`` if that is shorter), doubling up to ``poll``.
    `ValueError` for a ``poll`` that is not a positive number."""
    if not (math.isfinite(poll) and poll > 0):
        raise ValueError(f"register poll must be a positive number of seconds, got {poll!r}")
    return ExponentialBackoff(min(APPROVAL_POLL, poll), poll)


#: Statuses that say no curator took the call (or it broke): worth retrying.
_TRANSIENT = frozenset({Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED})

Resp = TypeVar("Resp", bound=Message)
Req = TypeVar("Req", bound=Message)


class _Outage:
    """The retries of one stretch without an answer from any curator."""

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline
        self._retrier = Retrier(REGISTER_BACKOFF, random.Random())
        self._since: float | None = None

    def answered(self) -> None:
        """A curator answered: the next failure starts a new outage."""
        self._since = None
        self._retrier.reset()

    async def wait(self, error: RPCError, what: str) -> None:
        """Sleep before the next try, or raise ``error`` once the outage is past the deadline."""
        now = trio.current_time()
        if self._since is None:
            self._since = now
        left = self._since + self._deadline - now
        if left <= 0:
            raise RPCError(
                error.code,
                f"{what}: no curator answered for {self._deadline:g} s"
                f" (--register-deadline); last: {error.message or error.code.name}",
            ) from error
        delay = min(self._retrier.next_delay(), left)
        _log.warning(
            "%s: %s; retry %d in %.1f s (giving up in %.0f s)",
            what,
            error,
            self._retrier.failures,
            delay,
            left,
        )
        await trio.sleep(delay)


async def _call(
    client: Client, outage: _Outage, method: Method[Req, Resp], request: Req, what: str
) -> Resp:
    """``method``, repeated after transient errors (see the module docstring)."""
    while True:
        try:
            response = await client.unary(method, request)
        except RPCError as e:
            if e.code not in _TRANSIENT:
                outage.answered()
                raise
            await outage.wait(e, what)
            continue
        outage.answered()
        return response


async def register(
    root: Root,
    settings: disk.NodeSettings,
    intent: RegisterIntent,
    *,
    poll: float = 1.0,
    deadline: float = DEFAULT_DEADLINE,
) -> NodeCredentials:
    """Register, wait for approval, commit, save the node in ``root``; return its credentials.

    ``intent`` must already be saved in ``root`` (:func:`~.disk.save_register_intent`).
    ``poll``: most seconds between asks while not approved (`APPROVAL_POLL`
    first, doubling up to it); ``deadline``: how long an outage of every
    curator may last (see the module docstring).
    """
    if not deadline > 0:
        raise ValueError(f"register deadline must be positive, got {deadline!r}")
    asks = Retrier(approval_asks(poll))
    cluster = intent.cluster
    if cluster.cluster_directory is None:
        raise disk.NodeRootError("the cluster information holds no directory")
    ca = pki.decode_certificate(cluster.ca_certificate)
    node_key, join_key = intent.node_private_key, intent.join_private_key
    endpoints = endpoints_from_directory(cluster.cluster_directory, settings.curator_port)
    outage = _Outage(deadline)
    async with open_client(endpoints, client_context(ca), proof_key=node_key) as client:
        await _call(
            client,
            outage,
            methods.REGISTER_NODE,
            c.RegisterNodeRequest(
                register_ticket=intent.ticket, join_key=pki.public_key_bytes(join_key)
            ),
            "registering",
        )
        crash_point("register-after-register-rpc")
        _log.info(
            "registered; waiting for the owner to approve %s",
            identity.node_id(node_key.public_key()),
        )
        while True:
            try:
                committed = await _call(
                    client,
                    outage,
                    methods.COMMIT_NODE,
                    c.CommitNodeRequest(cluster_unlock_key=intent.cluster_unlock_key),
                    "waiting for approval",
                )
                break
            except RPCError as e:
                if e.code is not Status.FAILED_PRECONDITION:
                    raise
            await asks.sleep()
    crash_point("register-after-commit")
    credentials = NodeCredentials(
        node_key,
        pki.decode_certificate(committed.node_certificate),
        pki.decode_certificate(committed.ca_certificate),
    )
    sealed = SealedConfiguration(
        node_unlock_key=intent.node_unlock_key,
        join_key=join_key_bytes(join_key),
        cluster_ca=pki.encode_certificate(ca, pki.Encoding.DER),
    )
    await trio.to_thread.run_sync(
        functools.partial(
            disk.finish_bootstrap,
            root,
            settings,
            roles=NodeRoles(),
            directory=cluster.cluster_directory,
            sealed=sealed,
            credentials=credentials,
        )
    )
    _log.info("committed: %s", credentials.node_id)
    return credentials
