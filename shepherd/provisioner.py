"""The provisioner: keep the BMDB's provided machines and the provider's in step.

One reconciliation (:meth:`Provisioner.reconcile`)::

    list provider machines  ┐ at the same time
    list BMDB machines      ┘ (machine_provided of the provider's type)
    in both                       → managed
    in the provider only          → static provider (or --provisioner-assimilate):
                                      added to the BMDB; otherwise reported
    in the BMDB only              → reported (a machine removed from the static
                                      file, a device deleted at Equinix)
    decommissioned (or being so)  → ignored on both sides: not managed, not
                                      missing, never added again
    provider can CREATE, nothing unexplained, below --provisioner-max-machines:
      up to --provisioner-reservation-chunk-size creation slots, each
        wait for the creation rate limiter
        provider.create_machine(slot)           (idempotent per slot)
        machines + machine_provided, one transaction

Nothing is silently fixed: a machine missing on one side is logged and
listed in the :class:`Reconciliation`, never deleted; and a creating
provider whose machines disagree with the BMDB creates nothing until an
operator resolves it (``python -m bmdb forget-machine`` for a machine the
provider no longer lists; the seed's rule: counting machines against the limit
means little when the two sides disagree). A crash between a device's
creation and its BMDB write leaves a device the BMDB lacks: the next
reconciliation reports it and, the slot no longer being free, does not
create a second one.

The loop (:meth:`Provisioner.run`) reconciles at the rate of
``--provisioner-reconciler-rate``; a failed reconciliation (provider or
BMDB error) is logged and the loop goes on.

:func:`sync_provided` is the one-shot assimilation of a static list, kept for
the demo.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

import bmdb
from bmdb import ProviderStatus, Queries
from bmdb.errors import BMDBError
from bmdb.model import MachineProvided
from shepherd.providers import Capability, Machine, Provider, ProviderError
from shepherd.rate_limit import Rate, RateLimiter

logger = logging.getLogger("shepherd.provisioner")


@dataclass(frozen=True)
class ProvisionerConfig:
    """The seed's provisioner flags."""

    #: Stop creating at this many managed machines; 0: no limit.
    max_machines: int = 50
    #: At most this many creations per reconciliation.
    chunk_size: int = 20
    creation_rate: Rate = field(default_factory=lambda: Rate(5.0, 1))
    reconciler_rate: Rate = field(default_factory=lambda: Rate(60.0, 1))
    #: Add machines the (creating) provider has and the BMDB lacks, instead of
    #: reporting them. The static provider always assimilates.
    assimilate: bool = False

    def __post_init__(self) -> None:
        if self.max_machines < 0:
            raise ValueError(f"max machines must not be negative, got {self.max_machines}")
        if self.chunk_size < 1:
            raise ValueError(f"reservation chunk size must be at least 1, got {self.chunk_size}")


@dataclass
class Reconciliation:
    """What one reconciliation found and did (provider ids)."""

    managed: int = 0
    #: In the provider, not in the BMDB (and not added).
    missing_in_bmdb: list[str] = field(default_factory=list)
    #: In the BMDB, not in the provider.
    missing_in_provider: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    #: Creation slot → why creating on it failed.
    failed: dict[str, str] = field(default_factory=dict)
    #: Creation was skipped because the two sides disagree.
    refused: bool = False


class Provisioner:
    """Reconciles one provider with the BMDB; see the module docstring."""

    component = "shepherd-provisioner"

    def __init__(self, provider: Provider, config: ProvisionerConfig | None = None) -> None:
        self.provider = provider
        self.config = config or ProvisionerConfig()
        self._creation_limiter = RateLimiter(self.config.creation_rate)
        #: Results of the loop's reconciliations (the last few), for tests and status.
        self.history: list[Reconciliation | BaseException] = []

    async def run(self, conn: bmdb.Connection) -> None:
        """Reconcile forever at the reconciler rate. Never returns; cancel to stop.

        A reconciliation that fails (:class:`ProviderError`,
        :class:`BMDBError`) is logged and the next one runs on schedule.
        """
        limiter = RateLimiter(self.config.reconciler_rate)
        while True:
            await limiter.acquire()
            try:
                result: Reconciliation | BaseException = await self.reconcile(conn)
            except (ProviderError, BMDBError) as exc:
                logger.error("%s: reconciliation failed: %s", self.provider.type, exc)
                result = exc
            self.history = [*self.history[-9:], result]

    async def reconcile(self, conn: bmdb.Connection) -> Reconciliation:
        """One reconciliation. Raises the provider's or the BMDB's errors from
        the listings; creation failures are recorded per slot instead."""
        provider = self.provider
        listed: list[Machine] = []
        known: list[MachineProvided] = []
        retired: set[str] = set()

        failures: list[ProviderError | BMDBError] = []

        async def list_provider() -> None:
            nonlocal listed
            try:
                listed = await provider.list_machines()
            except ProviderError as exc:
                failures.append(exc)
                nursery.cancel_scope.cancel()  # the other listing is of no use now

        async def list_bmdb() -> None:
            async def read(q: Queries) -> tuple[list[MachineProvided], set[str]]:
                return (
                    await q.provided_by_provider(provider.type),
                    await q.decommissioned_provider_ids(provider.type),
                )

            nonlocal known, retired
            try:
                known, retired = await conn.transact(read)
            except BMDBError as exc:
                failures.append(exc)
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(list_provider)
            nursery.start_soon(list_bmdb)
        if failures:
            raise failures[0]

        result = Reconciliation()
        # Machines being or done decommissioned are neither managed nor
        # missing, and never added again (a static file may still list them).
        in_provider = {m.id: m for m in listed if m.id not in retired}
        in_bmdb = {p.provider_id: p for p in known if p.provider_id not in retired}
        creating = Capability.CREATE in provider.capabilities
        assimilate = self.config.assimilate or not creating
        only_provider = sorted(set(in_provider) - set(in_bmdb))
        result.missing_in_provider = sorted(set(in_bmdb) - set(in_provider))
        for pid in result.missing_in_provider:
            logger.error(
                "%s machine %s (BMDB %s) is in the BMDB but not at the provider",
                provider.type,
                pid,
                in_bmdb[pid].machine_id,
            )
        if assimilate:
            # The static file is the truth for addresses too (the updater
            # refreshes creating providers' machines).
            stale = (
                []
                if creating
                else [
                    in_bmdb[pid]
                    for pid, m in in_provider.items()
                    if pid in in_bmdb
                    and (in_bmdb[pid].address, in_bmdb[pid].location) != (m.address, m.location)
                ]
            )
            if only_provider or stale:
                result.added, result.updated = await self._record(
                    conn, [in_provider[p] for p in only_provider], stale, in_provider
                )
        else:
            result.missing_in_bmdb = only_provider
            for pid in only_provider:
                logger.error(
                    "%s machine %s is at the provider but not in the BMDB", provider.type, pid
                )
        result.managed = len(set(in_provider) & set(in_bmdb)) + len(result.added)
        logger.info(
            "%s: %d managed, %d added, %d updated, %d missing in BMDB, %d missing at provider",
            provider.type,
            result.managed,
            len(result.added),
            len(result.updated),
            len(result.missing_in_bmdb),
            len(result.missing_in_provider),
        )
        if creating:
            if result.missing_in_bmdb or result.missing_in_provider:
                logger.error(
                    "%s: provider and BMDB disagree; creating nothing until an operator "
                    "resolves it (or runs with --provisioner-assimilate)",
                    provider.type,
                )
                result.refused = True
            else:
                await self._create(conn, result)
        return result

    async def _record(
        self,
        conn: bmdb.Connection,
        new: list[Machine],
        stale: list[MachineProvided],
        listed: dict[str, Machine],
    ) -> tuple[list[str], list[str]]:
        async def write(q: Queries) -> tuple[list[str], list[str]]:
            added = []
            for machine in new:
                await _add(q, self.provider.type, machine)
                added.append(machine.id)
            for current in stale:
                m = listed[current.provider_id]
                await q.update_provided(current.machine_id, m.address, m.location, current.status)
            return added, [s.provider_id for s in stale]

        return await conn.transact(write)

    async def _create(self, conn: bmdb.Connection, result: Reconciliation) -> None:
        limit = self.config.max_machines
        if limit and result.managed >= limit:
            logger.info("%s: at the limit of %d machines", self.provider.type, limit)
            return
        needed = self.config.chunk_size
        if limit:
            needed = min(needed, limit - result.managed)
        slots = (await self.provider.creation_slots())[:needed]
        if not slots:
            logger.info("%s: no free creation slots", self.provider.type)
            return
        logger.info("%s: creating %d machine(s)", self.provider.type, len(slots))
        for slot in slots:
            await self._creation_limiter.acquire()
            try:
                machine = await self.provider.create_machine(slot)
            except ProviderError as exc:
                logger.error("%s: creating on %s failed: %s", self.provider.type, slot, exc)
                result.failed[slot] = str(exc)
                continue

            async def write(q: Queries, machine: Machine = machine) -> None:
                await _add(q, self.provider.type, machine)

            try:
                await conn.transact(write)
            except BMDBError as exc:
                # The device exists; the next reconciliation reports it.
                logger.error(
                    "%s: machine %s created on %s but not recorded in the BMDB: %s",
                    self.provider.type,
                    machine.id,
                    slot,
                    exc,
                )
                result.failed[slot] = f"created {machine.id}, BMDB write failed: {exc}"
                continue
            result.created.append(machine.id)
            logger.info("%s: machine %s created on %s", self.provider.type, machine.id, slot)


async def _add(q: Queries, provider_type: str, machine: Machine) -> None:
    machine_id = await q.new_machine()
    await q.add_provided(
        machine_id,
        provider_type,
        machine.id,
        machine.address,
        machine.location,
        machine.status or ProviderStatus.RUNNING,
    )


@dataclass(frozen=True)
class SyncResult:
    """Provider ids added to and refreshed in the BMDB by :func:`sync_provided`."""

    added: list[str]
    updated: list[str]


async def sync_provided(conn: bmdb.Connection, provider: Provider) -> SyncResult:
    """Make the BMDB's ``machine_provided`` tags match ``provider``'s list.

    One transaction: either every listed machine is recorded or none is.
    Idempotent; running it again without changes updates nothing. Raises
    :class:`bmdb.errors.BMDBError` subclasses (e.g. ``InvalidArgument`` if
    the provider's type is unknown to the BMDB) and the provider's errors.
    """
    machines = await provider.list_machines()

    async def sync(q: Queries) -> SyncResult:
        known = {p.provider_id: p for p in await q.provided_by_provider(provider.type)}
        added: list[str] = []
        updated: list[str] = []
        for machine in machines:
            current = known.get(machine.id)
            if current is None:
                machine_id = await q.new_machine()
                await q.add_provided(
                    machine_id,
                    provider.type,
                    machine.id,
                    machine.address,
                    machine.location,
                    ProviderStatus.RUNNING,
                )
                added.append(machine.id)
            elif (current.address, current.location) != (machine.address, machine.location):
                await q.update_provided(
                    current.machine_id, machine.address, machine.location, current.status
                )
                updated.append(machine.id)
        return SyncResult(added, updated)

    result = await conn.transact(sync)
    logger.info(
        "%s provider: %d machine(s) listed, %d added to the BMDB, %d updated",
        provider.type,
        len(machines),
        len(result.added),
        len(result.updated),
    )
    return result
