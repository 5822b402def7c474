"""The pruner: the BMDB's retention policy (`bmdb.retention`) on a schedule.

Every ``interval`` seconds it deletes, from the work history and the audit
log, the rows the policy does not keep (each machine's newest
``keep_last`` and everything newer than ``keep_newer_than`` stay), in the
small batches of `bmdb.retention.prune` that never block a worker. A round
that fails (the BMDB unreachable, a failover) is logged and retried with
backoff; what it deleted before the failure stays deleted.

Off unless the Shepherd is given a policy (``--retention-keep-last N
--retention-keep-newer-than AGE``), on purpose: the audit log is the
operators' record of what they did and why, and how long to keep it is
their decision (an audit requirement may ask for years), not a default a
program should make for them; and the tables grow slowly (a few hundred
bytes per claim, nothing per heartbeat: README, "What a fleet costs the
BMDB per day"), so an operator who has not decided loses nothing but
disk. Several Shepherds may all run it: two prunes of one table delete the
same rows, the later batch waiting a few milliseconds for the other's.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import trio

import bmdb
from bmdb.errors import BMDBError
from bmdb.retention import PruneResult, RetentionPolicy, prune
from common.backoff import FULL_JITTER, ExponentialBackoff, Retrier

logger = logging.getLogger("shepherd.pruner")

#: Seconds between two rounds by default: retention is about days, and a
#: round over a day's rows is short.
DEFAULT_INTERVAL = 3600.0

_BACKOFF = ExponentialBackoff(initial=1.0, maximum=300.0, jitter=FULL_JITTER)


@dataclass(frozen=True)
class PrunerConfig:
    """What the pruner keeps, and how often it runs."""

    policy: RetentionPolicy
    interval: float = DEFAULT_INTERVAL

    def __post_init__(self) -> None:
        if not self.interval > 0:
            raise ValueError(f"pruner interval must be positive, got {self.interval!r}")


class Pruner:
    """Prunes the BMDB's work history and audit log every ``config.interval``."""

    def __init__(self, conn: bmdb.Connection, config: PrunerConfig) -> None:
        self.conn = conn
        self.config = config

    async def round(self) -> list[PruneResult]:
        """One prune of both tables; raises the BMDB's errors (`BMDBError`)."""
        return await prune(self.conn, self.config.policy)

    async def run(self) -> None:
        """Run rounds until cancelled, the first at once; failed rounds are
        logged and retried with backoff."""
        policy = self.config.policy
        logger.info(
            "pruning the work history and the audit log every %g s: keeping each"
            " machine's newest %d rows and everything newer than %s",
            self.config.interval,
            policy.keep_last,
            policy.keep_newer_than,
        )
        retrier = Retrier(_BACKOFF, random.Random())
        while True:
            try:
                results = await self.round()
            except BMDBError as e:
                logger.warning("prune failed: %s", e)
                await retrier.sleep()
                continue
            retrier.reset()
            for r in results:
                if r.deleted:
                    logger.info("%s: deleted %d rows", r.table, r.deleted)
            await trio.sleep(self.config.interval)
