"""Test hook: while this curator believes it leads, count up a key with leader-guarded writes.

With ``METROPOLIS_TEST_LEADER_PROBE=1`` in a node's environment, its
curator runs :func:`run_probe` beside the election. Whenever the election
says this curator leads, the probe repeats::

    read /test/leader-probe            "<node id> <term> <count>"
    wait a moment                      (a stale leader is most likely paused here)
    write "<node id> <term> <count+1>" guarded by the term (Leader.txn), no other check

Nothing but the election guard keeps two curators that both believe they
lead from writing over each other, so a test that reads the key's history
back from etcd sees whether the guard held: one (node, term) per
contiguous run, counts without gaps or repeats. Without the variable the
probe never runs.

Cancellation: cancelled with the curator. Errors: none raised; a refused
write (``NotLeader``) waits for this curator's next term, an etcd error is
logged and retried.
"""

from __future__ import annotations

import logging

import trio

from common.backoff import ExponentialBackoff, Retrier
from metropolis.consensus.client import KV, EtcdError, Put
from metropolis.curator.election import ElectionState, Leader, NotLeader
from metropolis.curator.state import PROBE_KEY
from metropolis.event import ReadOnlyValue

__all__ = ["PROBE_ENV", "parse_probe", "run_probe"]

#: Set to 1 to run the probe (tests only).
PROBE_ENV = "METROPOLIS_TEST_LEADER_PROBE"


def parse_probe(value: bytes) -> tuple[str, int, int]:
    """(node id, term, count) of a probe value; ValueError if it is not one."""
    node_id, term, count = value.decode().split()
    return node_id, int(term), int(count)


def _is_leader(state: ElectionState) -> bool:
    return isinstance(state, Leader)


async def run_probe(
    kv: KV,
    election: ReadOnlyValue[ElectionState],
    node_id: str,
    *,
    pause: float = 0.1,
    logger: logging.Logger | None = None,
) -> None:
    """Count up :data:`PROBE_KEY` while leading (see the module docstring); until cancelled."""
    log = logger or logging.getLogger("metropolis.curator.probe")
    # Exact waits (no jitter): one probe per node, nothing to spread.
    retrier = Retrier(ExponentialBackoff(initial=pause, maximum=max(pause, 2.0)))
    with election.watch() as watcher:
        while True:
            leader = await watcher.get(_is_leader)
            assert isinstance(leader, Leader)
            while True:
                try:
                    stored = await kv.get(PROBE_KEY)
                    count = 0 if stored is None else parse_probe(stored.value)[2]
                    await trio.sleep(pause)
                    value = f"{node_id} {leader.revision} {count + 1}".encode()
                    await leader.txn(kv, [], [Put(PROBE_KEY, value)])
                    retrier.reset()
                except NotLeader:
                    log.info("probe write refused: term %d is over", leader.revision)
                    break
                except EtcdError as e:
                    log.info("probe: %s; retrying", e)
                    await retrier.sleep()
