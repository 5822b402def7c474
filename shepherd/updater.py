"""The updater: keep what the BMDB knows about provided machines fresh.

Every pass (at most one per ``--updater-iteration-rate``)::

    machine_provided rows of the provider's type
      minus machines in backoff after a failure
      minus settled machines checked less than --updater-settled-interval ago
      in batches of --updater-batch-size:
        provider.refresh(id) for the whole batch at once
          address, location, status changed? → one transaction per batch
          MachineNotFound                    → status Missing (never deleted)
          any other ProviderError            → that machine backs off
                                               (x2 per failure, 1 min .. 30 min)

A machine is settled when its last refresh changed nothing and it is
Running: as in the seed, such machines are asked again only every 30
minutes by default, so that a large fleet does not cost one API call per
machine per minute. Everything else (provisioning, stopped, just changed) is
asked every pass.

The status is the provider's (Equinix: the device state) or, for a machine
with a BMC, its power state: On is Running; Off, Paused and the transitions
are Stopped. An address the provider no longer reports is kept (a device
being reinstalled has none for a while) rather than erased.

A failure of one machine (a BMC with a wrong password, unreachable, a 404)
is logged with its cause and kept in :attr:`UpdatePass.failed`; the pass and
the loop go on. A failing BMDB ends the pass; the loop retries on schedule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

import bmdb
from bmdb import ProviderStatus, Queries
from bmdb.errors import BMDBError
from bmdb.model import MachineProvided
from common.backoff import ExponentialBackoff
from shepherd.providers import Machine, MachineNotFound, PowerState, Provider, ProviderError
from shepherd.rate_limit import Rate, RateLimiter

logger = logging.getLogger("shepherd.updater")

_POWER_STATUS = {
    PowerState.ON: ProviderStatus.RUNNING,
    PowerState.OFF: ProviderStatus.STOPPED,
    PowerState.PAUSED: ProviderStatus.STOPPED,
    PowerState.POWERING_ON: ProviderStatus.STOPPED,
    PowerState.POWERING_OFF: ProviderStatus.STOPPED,
}


@dataclass(frozen=True)
class UpdaterConfig:
    #: At most one pass per this many seconds (the seed's 1 minute).
    iteration_interval: float = 60.0
    #: Machines refreshed at once, and written in one transaction.
    batch_size: int = 50
    #: A settled machine (unchanged and Running) is refreshed again after this long.
    settled_interval: float = 1800.0
    #: Backoff of a machine whose refresh failed: first, growth, cap (seconds).
    backoff_initial: float = 60.0
    backoff_exponent: float = 2.0
    backoff_maximum: float = 1800.0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {self.batch_size}")


@dataclass
class UpdatePass:
    """What one pass did (provider ids)."""

    checked: int = 0
    #: In backoff, not asked.
    skipped: int = 0
    updated: list[str] = field(default_factory=list)
    #: Provider id → why its refresh failed.
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class _Backoff:
    until: float
    failures: int


def status_of(machine: Machine) -> ProviderStatus | None:
    """The status to record: the provider's, else derived from the BMC's power state."""
    if machine.status is not None:
        return machine.status
    if machine.power is not None:
        return _POWER_STATUS[machine.power]
    return None


class Updater:
    """Refreshes one provider's machines in the BMDB; see the module docstring."""

    component = "shepherd-updater"

    def __init__(
        self,
        provider: Provider,
        config: UpdaterConfig | None = None,
        *,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.provider = provider
        self.config = config or UpdaterConfig()
        self._clock = clock
        self._backoff: dict[str, _Backoff] = {}
        #: Provider id → when a settled machine is due again.
        self._settled: dict[str, float] = {}
        #: The last few passes (or the errors that ended them), for tests and status.
        self.history: list[UpdatePass | BaseException] = []

    async def run(self, conn: bmdb.Connection) -> None:
        """Run passes forever at the configured rate. Never returns; cancel to stop."""
        limiter = RateLimiter(Rate(self.config.iteration_interval, 1))
        while True:
            await limiter.acquire()
            try:
                result: UpdatePass | BaseException = await self.update_once(conn)
            except (BMDBError, ProviderError) as exc:
                logger.error("%s: update pass failed: %s", self.provider.type, exc)
                result = exc
            self.history = [*self.history[-9:], result]

    async def update_once(self, conn: bmdb.Connection) -> UpdatePass:
        """One pass over every provided machine not in backoff."""

        async def read(q: Queries) -> list[MachineProvided]:
            return await q.provided_by_provider(self.provider.type)

        rows = await conn.transact(read)
        now = self._clock()
        result = UpdatePass()
        due = []
        for row in rows:
            backoff = self._backoff.get(row.provider_id)
            failed_recently = backoff is not None and backoff.until > now
            if failed_recently or self._settled.get(row.provider_id, now) > now:
                result.skipped += 1
            else:
                due.append(row)
        size = self.config.batch_size
        for start in range(0, len(due), size):
            await self._batch(conn, due[start : start + size], result)
        result.checked = len(due)
        logger.info(
            "%s: %d checked, %d updated, %d failed, %d in backoff",
            self.provider.type,
            result.checked,
            len(result.updated),
            len(result.failed),
            result.skipped,
        )
        return result

    async def _batch(
        self, conn: bmdb.Connection, rows: list[MachineProvided], result: UpdatePass
    ) -> None:
        fresh: dict[str, Machine | None] = {}  # None: the provider lost it

        async def refresh(row: MachineProvided) -> None:
            pid = row.provider_id
            try:
                fresh[pid] = await self.provider.refresh(pid)
            except MachineNotFound:
                fresh[pid] = None
            except ProviderError as exc:
                self._fail(pid, str(exc), result)
            else:
                self._backoff.pop(pid, None)

        async with trio.open_nursery() as nursery:
            for row in rows:
                nursery.start_soon(refresh, row)

        changes: list[tuple[MachineProvided, str | None, str | None, ProviderStatus]] = []
        for row in rows:
            if row.provider_id not in fresh:
                continue
            machine = fresh[row.provider_id]
            if machine is None:
                want = (row.address, row.location, ProviderStatus.MISSING)
            else:
                want = (
                    machine.address or row.address,
                    machine.location or row.location,
                    status_of(machine) or row.status,
                )
            if want != (row.address, row.location, row.status):
                changes.append((row, *want))
                self._settled.pop(row.provider_id, None)
            elif row.status == ProviderStatus.RUNNING:
                self._settled[row.provider_id] = self._clock() + self.config.settled_interval
            else:
                self._settled.pop(row.provider_id, None)
        if not changes:
            return

        async def write(q: Queries) -> None:
            for row, address, location, status in changes:
                await q.update_provided(row.machine_id, address, location, status)

        await conn.transact(write)
        for row, address, location, status in changes:
            logger.info(
                "%s machine %s: address %s, location %s, status %s",
                self.provider.type,
                row.provider_id,
                address,
                location,
                status,
            )
            result.updated.append(row.provider_id)

    def _fail(self, provider_id: str, cause: str, result: UpdatePass) -> None:
        previous = self._backoff.get(provider_id)
        failures = 1 if previous is None else previous.failures + 1
        config = self.config
        policy = ExponentialBackoff(
            config.backoff_initial, config.backoff_maximum, config.backoff_exponent
        )
        interval = policy.delay(failures)
        self._backoff[provider_id] = _Backoff(self._clock() + interval, failures)
        result.failed[provider_id] = cause
        logger.warning(
            "%s machine %s: refresh failed, next try in %.0fs: %s",
            self.provider.type,
            provider_id,
            interval,
            cause,
        )
