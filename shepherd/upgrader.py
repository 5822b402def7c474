"""The upgrader: move the machines of a rolling upgrade run to the new image, in order.

A control loop processor (see :mod:`shepherd.control_loop`) under the BMDB
process ``ShepherdUpgrade``; ``python -m shepherd upgrade`` creates the run
(:mod:`shepherd.upgrade`) and asks every machine of it to write the image to
its inactive slot at once (``ask_writes``: a request without ``activate``;
no node goes down for it). One machine at a time per worker::

    source (in the claiming transaction)
      machines_for_upgrade(1)        requested ones first (a worker died while
                                     upgrading them), then pending ones of the
                                     lowest phase, while the run has room
    handle
      pending: the run's writes      a machine's agent says FAILED ──▶ failed,
                                       the run stops (no node went down)
                                     not all WRITTEN ──▶ wait, polling (the
                                       detail says "waiting: ..."); past
                                       `stage_allowance` from the run's
                                       start: failed, the run stops
      owner.nodes()                  the cluster's view; the machine's node by
                                     the key of its installation report
      pending:
        already on the image         ──▶ upgraded (nothing asked of the agent)
        the run's order refreshed    phases from this view (the leader moves)
        gate (shepherd.upgrade_plan) WAIT ──▶ fail "waiting: ..." (short backoff,
                                              retried: the cause is in the views)
                                     REFUSE ──▶ failed, the run stops
        request_upgrade(generation)  one transaction, the run row locked: its
                                     UpgradeRequest, the written generation
                                     with activate, is carried to the agent
                                     from now on (the machine is "down": it
                                     points its next boot at the slot, reboots)
      requested: wait, polling       every `poll` seconds, until the deadline
        the agent says FAILED        ──▶ failed (nothing changed), the run stops
        the node went back / the     ──▶ rolled-back, with the cause, the run stops
          agent says ROLLED_BACK
        the node runs the image,     ──▶ upgraded; the last one finishes the run
          HEALTHY, slot permanent,
          a voter again if it was
        past the deadline            ──▶ failed ("no healthy node on ... within"),
                                         the run stops

Every state is in the BMDB (``machine_upgrade``, migration 0011) before the
step that depends on it, so a Shepherd killed anywhere resumes where it was:
a requested machine is picked up first and its outcome waited for (its
request's time, stored, bounds the wait); a pending one is gated again. The
agent never runs one generation twice (its own state file), so a request
carried again is harmless.

The deadline of a requested machine: its request time plus `stage_allowance`
(download and write of the image, the reboot) plus twice the run's health
timeout (the node's own bound, counted from its boot, and the old slot's
boot after a rollback).

Needs the cluster owner's credentials (``--cluster-owner-key`` with
``--cluster-owner-root`` or ``--cluster-owner-info``, as the decommissioner):
without them a machine waits, saying why.
"""

from __future__ import annotations

import logging
import uuid
from typing import NoReturn

import trio

from bmdb import Backoff, Process, Queries, Work
from bmdb.model import MachineUpgrade, UpgradeRun, UpgradeState, UpgradeTarget
from common.text import printable
from metropolis.errors import MetropolisError
from metropolis.owner import NodeRow, OwnerAccess
from shepherd.control_loop import ProcessingFailed
from shepherd.upgrade import write_request
from shepherd.upgrade_plan import Verdict, gate, phase, upgraded, went_back

logger = logging.getLogger("shepherd.upgrader")

#: A machine that waits for its turn is looked at again after 2 s, growing
#: to 30 s (the cause stays in the views meanwhile).
WAIT_BACKOFF = Backoff(initial=2, maximum=30, exponent=1.5)
#: A failure of the upgrader itself (the cluster unreachable, no credentials).
DEFAULT_BACKOFF = Backoff(initial=10, maximum=300, exponent=2)
#: Seconds between looks at a machine being upgraded.
DEFAULT_POLL = 1.0
#: Seconds allowed for the download and write of the image and the reboot.
DEFAULT_STAGE_ALLOWANCE = 600.0
#: Workers of the Shepherd's upgrade loop: each holds one machine for its
#: whole upgrade, so a run's --max-unavailable above this goes this many at once.
UPGRADE_WORKERS = 4


class Upgrader:
    """Upgrades machines of the running run; a :class:`shepherd.control_loop.Processor`."""

    component = "shepherd-upgrader"
    process = Process.SHEPHERD_UPGRADE

    def __init__(
        self,
        owner: OwnerAccess | None,
        *,
        poll: float = DEFAULT_POLL,
        stage_allowance: float = DEFAULT_STAGE_ALLOWANCE,
        backoff: Backoff = DEFAULT_BACKOFF,
        wait_backoff: Backoff = WAIT_BACKOFF,
    ) -> None:
        if not poll > 0 or not stage_allowance > 0:
            raise ValueError("poll and stage allowance must be positive")
        self.owner = owner
        self.poll = poll
        self.stage_allowance = stage_allowance
        self.backoff = backoff
        self.wait_backoff = wait_backoff

    async def source(self, q: Queries) -> UpgradeTarget | None:
        targets = await q.machines_for_upgrade(1)
        return targets[0] if targets else None

    def machine_id(self, task: UpgradeTarget) -> uuid.UUID:
        return task.machine.machine_id

    async def handle(self, work: Work, task: UpgradeTarget) -> None:
        run, machine = task.run, task.machine
        if machine.state is UpgradeState.PENDING:
            # Before anything else (the cluster's view included): no node
            # goes down while a machine of the run may still fail its write.
            await self._writes_done(work, run, machine)
        if self.owner is None:
            raise ProcessingFailed(
                "no owner credentials to see the cluster (start the Shepherd with "
                "--cluster-owner-key and --cluster-owner-root or --cluster-owner-info)"
            )
        key = task.node_public_key
        if key is None:
            await self._stop(work, run, machine, UpgradeState.FAILED, "no installed node")
        rows = await self._nodes()
        row = _by_key(rows, key)
        if row is None:
            await self._stop(
                work, run, machine, UpgradeState.FAILED, "its node is not in the cluster"
            )
        if machine.state is UpgradeState.PENDING:
            if upgraded(row, run.image_digest, was_voter=row.etcd == "voter"):
                await self._succeed(work, run, machine, "already on the image", row)
                return
            await self._start(work, run, machine, row, rows)
        await self._await_outcome(work, run, machine.machine_id, was_voter=row.etcd == "voter")

    async def _writes_done(self, work: Work, run: UpgradeRun, machine: MachineUpgrade) -> None:
        """Return once every pending machine of the run that was asked to
        write the image (`shepherd.upgrade.ask_writes`) reported it written,
        looking every `poll` seconds (holding the machine's work: the reports
        come within the writes' time, a backoff would only add to it). A
        write that failed stops the run with its cause before any node goes
        down; writes not reported within `stage_allowance` of the run's
        start stop it too."""

        async def look(q: Queries) -> tuple[list[MachineUpgrade], float | None]:
            members = await q.upgrade_machines(run.run_id)
            return [m for m, _ in members], await q.upgrade_run_age(run.run_id)

        noted = ""
        while True:
            members, age = await work.transact(look)
            if age is None:
                raise ProcessingFailed(f"upgrade run {run.run_id} is gone")
            asked = [
                m for m in members if m.state is UpgradeState.PENDING and m.generation is not None
            ]
            failed = [m for m in asked if m.agent_state == "failed"]
            if failed:
                broken = failed[0]
                detail = f"writing the image: the agent: {broken.agent_detail or 'no detail'}"
                if broken.machine_id != machine.machine_id:
                    await self._stop(work, run, broken, UpgradeState.FAILED, detail, own=machine)
                await self._stop(work, run, machine, UpgradeState.FAILED, detail)
            writing = [m for m in asked if m.agent_state != "written"]
            if not writing:
                return
            if age >= self.stage_allowance:
                late = writing[0]
                detail = (
                    f"no report of its write of the image within {self.stage_allowance:g} s "
                    f"(the agent: {late.agent_state or 'no report'})"
                )
                if late.machine_id != machine.machine_id:
                    await self._stop(work, run, late, UpgradeState.FAILED, detail, own=machine)
                await self._stop(work, run, machine, UpgradeState.FAILED, detail)
            why = f"waiting: {len(writing)} machine(s) of the run still writing the image"
            if why != noted:
                await _note(work, run, machine, why)
                noted = why
            await trio.sleep(self.poll)

    async def _nodes(self) -> list[NodeRow]:
        assert self.owner is not None
        try:
            async with self.owner.open() as owner:
                return await owner.nodes()
        except MetropolisError as exc:
            raise ProcessingFailed(
                f"cannot read the cluster's nodes: {printable(str(exc))}", self.wait_backoff
            ) from exc

    async def _start(
        self,
        work: Work,
        run: UpgradeRun,
        machine: MachineUpgrade,
        row: NodeRow,
        rows: list[NodeRow],
    ) -> None:
        """Gate the machine against the cluster's view; request its upgrade."""
        members = await work.transact(lambda q: q.upgrade_machines(run.run_id))
        by_key = {r.public_key: r for r in rows}
        order: list[tuple[uuid.UUID, int, int]] = []
        for position, (m, key) in enumerate(members):
            node = by_key.get(key) if key is not None else None
            order.append((m.machine_id, m.phase if node is None else phase(node), position))
        if [(m.machine_id, m.phase) for m, _ in members] != [(o[0], o[1]) for o in order]:
            await work.transact(lambda q: q.set_upgrade_order(run.run_id, order))
        mine = phase(row)
        not_done = [(m, key) for m, key in members if not m.state.final]
        in_flight = [
            by_key[key].node_id
            for m, key in not_done
            if m.state is UpgradeState.REQUESTED and key in by_key
        ]
        earlier = sum(
            1
            for m, key in not_done
            if m.machine_id != machine.machine_id and key in by_key and phase(by_key[key]) < mine
        )
        consensus = sum(
            1
            for m, key in not_done
            if m.machine_id != machine.machine_id and key in by_key and phase(by_key[key]) >= 1
        )
        decision = gate(
            row,
            rows,
            in_flight=in_flight,
            max_unavailable=run.max_unavailable,
            earlier_not_done=earlier,
            consensus_not_done=consensus,
        )
        if decision.verdict is Verdict.REFUSE:
            await self._stop(work, run, machine, UpgradeState.FAILED, decision.why, row)
        if decision.verdict is Verdict.WAIT:
            why = f"waiting: {decision.why}"
            await work.transact(lambda q: q.note_upgrade(run.run_id, machine.machine_id, why))
            raise ProcessingFailed(why, self.wait_backoff)

        async def request(q: Queries) -> str | None:
            # The generation whose write the run asked for, if it did.
            generation = machine.generation or await q.next_upgrade_generation(machine.machine_id)
            raw = write_request(run, machine.root_device, generation, activate=True)
            return await q.request_upgrade(run.run_id, machine.machine_id, generation, raw)

        why_not = await work.transact(request)
        if why_not is not None:
            why = f"waiting: {why_not}"
            await work.transact(lambda q: q.note_upgrade(run.run_id, machine.machine_id, why))
            raise ProcessingFailed(why, self.wait_backoff)
        logger.info(
            "machine %s: upgrade to %s requested (node %s, phase %d)",
            machine.machine_id,
            run.image_digest,
            row.node_id,
            mine,
        )

    async def _await_outcome(
        self, work: Work, run: UpgradeRun, machine_id: uuid.UUID, *, was_voter: bool
    ) -> None:
        """Poll the BMDB (the agent's reports) and the cluster until the
        requested machine's upgrade ends; record how."""
        limit = self.stage_allowance + 2 * run.health_timeout
        while True:
            found = await work.transact(lambda q: q.machine_upgrade(run.run_id, machine_id))
            if found is None:
                raise ProcessingFailed(f"machine {machine_id} is no longer in run {run.run_id}")
            machine, key, age = found
            if machine.state is not UpgradeState.REQUESTED or age is None:
                return  # nothing to wait for (nobody else holds this work)
            if machine.agent_state == "failed":
                detail = f"the agent: {machine.agent_detail or 'no detail'}"
                await self._stop(work, run, machine, UpgradeState.FAILED, detail)
            node = None
            if key is not None:
                try:
                    assert self.owner is not None
                    async with self.owner.open() as owner:
                        node = _by_key(await owner.nodes(), key)
                except MetropolisError as exc:
                    logger.info("machine %s: the cluster does not answer now: %s", machine_id, exc)
            if node is not None and upgraded(node, run.image_digest, was_voter=was_voter):
                await self._succeed(work, run, machine, "healthy on the image", node)
                return
            back = went_back(node, run.image_digest) if node is not None else None
            if back is None and machine.agent_state == "rolled-back":
                back = machine.agent_detail or "went back to the old slot"
            if back is not None:
                await self._stop(work, run, machine, UpgradeState.ROLLED_BACK, back, node)
            if age >= limit:
                said = (
                    f" (the agent: {machine.agent_state}: {machine.agent_detail})"
                    if machine.agent_state
                    else " (no report from the agent)"
                )
                await self._stop(
                    work,
                    run,
                    machine,
                    UpgradeState.FAILED,
                    f"no healthy node on {run.image_digest} within {limit:g} s of the "
                    f"request{said}",
                    node,
                )
            await trio.sleep(self.poll)

    async def _succeed(
        self, work: Work, run: UpgradeRun, machine: MachineUpgrade, detail: str, row: NodeRow
    ) -> None:
        """The machine is upgraded: recorded as the work finishes."""

        async def apply(q: Queries) -> None:
            after = await q.end_machine_upgrade(
                run.run_id,
                machine.machine_id,
                UpgradeState.UPGRADED,
                printable(detail),
                slot=row.slot,
                running_digest=row.image or None,
            )
            if after is not None and after.finished_at is not None:
                logger.info("upgrade run %s finished", run.run_id)

        await work.finish(apply)
        logger.info("machine %s: upgraded to %s (%s)", machine.machine_id, row.image, detail)

    async def _stop(
        self,
        work: Work,
        run: UpgradeRun,
        machine: MachineUpgrade,
        state: UpgradeState,
        detail: str,
        row: NodeRow | None = None,
        *,
        own: MachineUpgrade | None = None,
    ) -> NoReturn:
        """The machine's upgrade ended otherwise (``state``): recorded, the run
        stops with the cause, and the work fails with it (its history says why).
        With ``own``: the work is on that other machine of the run, which stays
        pending; its history names the machine that stopped the run."""
        detail = printable(detail)

        async def apply(q: Queries) -> None:
            await q.end_machine_upgrade(
                run.run_id,
                machine.machine_id,
                state,
                detail,
                slot=row.slot if row is not None else None,
                running_digest=row.image if row is not None and row.image else None,
            )

        await work.transact(apply)
        logger.warning(
            "machine %s: upgrade %s: %s; upgrade run %s stopped", machine.machine_id, state,
            detail, run.run_id,
        )  # fmt: skip
        if own is not None:
            raise ProcessingFailed(
                f"upgrade run stopped: machine {machine.machine_id} {state}: {detail}",
                self.backoff,
            )
        raise ProcessingFailed(f"upgrade {state}: {detail}", self.backoff)


async def _note(work: Work, run: UpgradeRun, machine: MachineUpgrade, detail: str) -> None:
    await work.transact(lambda q: q.note_upgrade(run.run_id, machine.machine_id, detail))


def _by_key(rows: list[NodeRow], key: bytes) -> NodeRow | None:
    return next((r for r in rows if r.public_key == key), None)
