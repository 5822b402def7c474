"""The Shepherd's approver: admit into the cluster the nodes the Shepherd installed, no others.

A node that registers with the cluster's ticket waits, NEW, for the owner's
approval. Anyone who has the ticket can register, so the ticket alone must
not be enough: the approver approves a NEW node only when its public key is
the ``node_public_key`` that a machine's agent reported in a *successful*
``OSInstallationReport`` for the generation currently requested for that
machine::

    curators  GetNodes                 -> NEW nodes (public keys)
    BMDB      request JOIN report      -> for each machine whose report is of the
              ON machine_id            requested generation: the report's bytes
              (same generation)           decoded; Success.node_public_key kept
    curators  ApproveNode              <- NEW nodes whose key is one of those

Never approved: a node of a machine an operator asked to decommission
(the decommissioner removes it from the cluster), a node whose key no
agent reported (logged once, at INFO, with its ID and address), one
reported only by an older generation than
the machine's current request (a reinstall replaced it), a report that
is an error, one whose bytes do not decode (strictly, as a message from
a peer: :func:`common.protobuf.parse_checked`) or whose own generation
disagrees with the row's, and a key that two machines report. The
approval is as trustworthy as the agents' reports: an agent the Shepherd
took over is trusted to report the key of the node it started (it runs
as root on that machine); nothing else is.

The report is read from its raw bytes (``os_installation_report_raw``),
not from columns derived from them, so that what is approved depends only
on what the agent sent.

Each round lists the NEW nodes first and asks the BMDB only when there are
some; approving is idempotent (a node approved in an earlier round is not
NEW any more), so a round may run any number of times, and two approvers
at once approve nothing twice (the curator takes a second approval as a
no-op).

When: a round every ``interval`` seconds, and at once when an agent's
report is stored (a notification, `bmdb.model.channels.INSTALL_REPORT`,
heard by a `bmdb.notify.Listener`). The reported node announced its key
before it calls the cluster, so a round at the report often finds it not
registered yet: a machine whose report was heard is looked after in
quick rounds (`QUICK_INTERVAL`, or twice the last round's time if
longer, so that rounds take at most a third of the approver's time) until
its node is approved or no longer NEW, its report names no node to
approve, or `AWAIT_FOR` seconds passed; then the interval alone again.
Notifications missed while the listener did not listen are covered by a
round when it listens again, and by the interval's rounds.

Errors of a round (curators unreachable: :class:`~metropolis.errors.MetropolisError`;
the BMDB: :class:`~bmdb.errors.BMDBError`) are logged and retried with
backoff (:mod:`common.backoff`) by :func:`run_approver`; it runs until
cancelled.
"""

from __future__ import annotations

import logging
import random
import uuid
from dataclasses import dataclass

import trio

import bmdb
from bmdb.errors import BMDBError
from bmdb.model import channels
from common.backoff import FULL_JITTER, ExponentialBackoff, Retrier
from common.protobuf import parse_checked
from metropolis.errors import MetropolisError
from metropolis.owner import NodeRow, OwnerAccess
from shepherd.proto.agent_callback import OsInstallationReport

__all__ = [
    "AWAIT_FOR",
    "DEFAULT_INTERVAL",
    "QUICK_INTERVAL",
    "Approval",
    "Approver",
    "InstalledNode",
    "installed_nodes",
    "run_approver",
]

_log = logging.getLogger("shepherd.approver")

#: Seconds between two rounds.
DEFAULT_INTERVAL = 5.0
#: Seconds between rounds while a reported machine's node is awaited.
QUICK_INTERVAL = 0.25
#: Seconds a reported machine's node is awaited in quick rounds.
AWAIT_FOR = 120.0

#: Waits after failed rounds: from 1 s up to a minute.
_BACKOFF = ExponentialBackoff(initial=1.0, maximum=60.0, jitter=FULL_JITTER)

_KEY_SIZE = 32

# Reports of the generation each machine is currently asked to install;
# the machine's provided address when there is one.
_INSTALLED = """
    SELECT r.machine_id, q.generation, r.os_installation_report_raw, p.provider_address
    FROM machine_os_installation_report r
    JOIN machine_os_installation_request q ON q.machine_id = r.machine_id
    LEFT JOIN machine_provided p ON p.machine_id = r.machine_id
    WHERE r.generation = q.generation
      AND NOT EXISTS (SELECT 1 FROM machine_decommission dc WHERE dc.machine_id = r.machine_id)
"""


@dataclass(frozen=True)
class InstalledNode:
    """A node some machine's agent reported it installed and started."""

    machine_id: uuid.UUID
    generation: int
    #: The machine's address as its provider gave it ("" if none).
    machine_address: str
    public_key: bytes


@dataclass(frozen=True)
class Approval:
    """One node the approver approved, and the machine it was installed on."""

    node_id: str
    node_address: str
    machine: InstalledNode


def _decode(machine_id: uuid.UUID, generation: int, raw: bytes) -> bytes | None:
    """The node key a report of ``generation`` carries; None (logged) if it carries none."""
    try:
        report = parse_checked(OsInstallationReport, bytes(raw))
    except ValueError as e:
        _log.warning("machine %s: installation report does not decode: %s", machine_id, e)
        return None
    if report.generation != generation:
        _log.warning(
            "machine %s: report says generation %d, stored as %d: ignored",
            machine_id,
            report.generation,
            generation,
        )
        return None
    if report.success is None:
        return None  # an error (or no result): nothing was installed
    key = report.success.node_public_key
    if len(key) != _KEY_SIZE:
        _log.warning(
            "machine %s: reported node key is %d bytes, want %d: ignored",
            machine_id,
            len(key),
            _KEY_SIZE,
        )
        return None
    return key


async def installed_nodes(conn: bmdb.Connection) -> dict[bytes, InstalledNode]:
    """Node public key -> the machine whose agent reported installing it, for the
    generation now requested for that machine. One read-only transaction."""
    rows = await conn.transact(lambda q: q.execute(_INSTALLED))
    found: dict[bytes, list[InstalledNode]] = {}
    for machine_id, generation, raw, address in rows:
        key = _decode(machine_id, generation, raw)
        if key is not None:
            found.setdefault(key, []).append(
                InstalledNode(machine_id, generation, address or "", key)
            )
    unique = {}
    for key, machines in found.items():
        if len(machines) == 1:
            unique[key] = machines[0]
        else:
            # One node cannot run on two machines: no report of it is believed.
            _log.warning(
                "machines %s report the same node key: none of them is approved",
                ", ".join(str(m.machine_id) for m in machines),
            )
    return unique


class Approver:
    """Approves the cluster's NEW nodes that the fleet installed (see the module)."""

    def __init__(
        self,
        access: OwnerAccess,
        conn: bmdb.Connection,
        *,
        quick_interval: float = QUICK_INTERVAL,
        await_for: float = AWAIT_FOR,
    ) -> None:
        self._access = access
        self._conn = conn
        self.quick_interval = quick_interval
        self.await_for = await_for
        #: Nodes already logged as not installed by us: each is logged once.
        self._refused: set[str] = set()
        #: Machines whose report was heard, until when (Trio time) their
        #: node is awaited in quick rounds.
        self._awaited: dict[uuid.UUID, float] = {}
        self._wake = trio.Event()
        #: Rounds run (each attempt, failed ones too).
        self.rounds = 0

    def reported(self, channel: str, payload: str) -> None:
        """A report on machine ``payload`` was stored (a notification): a
        round now, and quick ones until its node is approved (see the module)."""
        try:
            machine_id = uuid.UUID(payload)
        except ValueError:
            _log.warning("ignoring a notification on %s of %r", channel, payload[:100])
            return
        self._awaited[machine_id] = trio.current_time() + self.await_for
        self._wake.set()

    async def caught_up(self) -> None:
        """The listener listens (again): a round now, for what it missed."""
        self._wake.set()

    async def round(self) -> list[Approval]:
        """List NEW nodes, approve those the fleet installed; what was approved."""
        self.rounds += 1
        async with self._access.open() as owner:
            rows = await owner.nodes()
            new = [row for row in rows if row.state == "NEW"]
            if not new and not self._awaited:
                return []
            installed = await installed_nodes(self._conn)
            approved = []
            for row in new:
                machine = installed.get(row.public_key)
                if machine is None:
                    self._refuse(row)
                    continue
                await owner.approve_row(row)
                approval = Approval(row.node_id, row.address, machine)
                _log.info(
                    "approved %s, installed on machine %s (address %s) at generation %d",
                    row.node_id,
                    machine.machine_id,
                    machine.machine_address or "-",
                    machine.generation,
                )
                approved.append(approval)
            self._settle(rows, installed, approved)
            return approved

    def _settle(
        self, rows: list[NodeRow], installed: dict[bytes, InstalledNode], approved: list[Approval]
    ) -> None:
        """Stop awaiting the machines whose node is approved or no longer
        NEW, whose report names no node to approve, or awaited long enough."""
        if not self._awaited:
            return
        now = trio.current_time()
        states = {row.public_key: row.state for row in rows}
        done = {a.machine.public_key for a in approved}
        by_machine = {node.machine_id: node for node in installed.values()}
        for machine_id, until in list(self._awaited.items()):
            node = by_machine.get(machine_id)
            if (
                node is None
                or until < now
                or node.public_key in done
                or states.get(node.public_key, "NEW") != "NEW"
            ):
                del self._awaited[machine_id]

    def _refuse(self, row: NodeRow) -> None:
        if row.node_id in self._refused:
            return
        self._refused.add(row.node_id)
        _log.info(
            "not approving %s (address %s): no machine's agent reported its key "
            "in a successful installation of the requested generation",
            row.node_id,
            row.address or "none reported",
        )

    async def run(self, interval: float = DEFAULT_INTERVAL) -> None:
        """Run rounds every ``interval`` seconds, and when woken (`reported`,
        `caught_up`), until cancelled; failed rounds are logged and retried
        with backoff. Listens to no notification itself: `serve` does."""
        retrier = Retrier(_BACKOFF, random.Random())
        while True:
            self._wake = trio.Event()  # before the round: a report during it wakes the next
            started = trio.current_time()
            try:
                await self.round()
            except (MetropolisError, BMDBError) as e:
                _log.warning("approver round failed: %s", e)
                await retrier.sleep()
                continue
            retrier.reset()
            took = trio.current_time() - started
            wait = max(self.quick_interval, 2 * took) if self._awaited else interval
            with trio.move_on_after(wait):
                await self._wake.wait()

    async def serve(self, interval: float = DEFAULT_INTERVAL) -> None:
        """`run`, woken by the reports stored (a listener on the BMDB's
        `channels.INSTALL_REPORT`), until cancelled."""
        listener = self._conn.listener(
            [channels.INSTALL_REPORT], self.reported, on_listening=self.caught_up
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(listener.run)
            await self.run(interval)


async def run_approver(
    access: OwnerAccess, conn: bmdb.Connection, interval: float = DEFAULT_INTERVAL
) -> None:
    """An :class:`Approver` on ``access`` and ``conn``, served until cancelled
    (`Approver.serve`: every ``interval`` seconds, and when a report is stored)."""
    _log.info(
        "approving installed nodes every %g s and when an agent reports one, through the"
        " curators at %s",
        interval,
        ", ".join(e.address for e in access.endpoints),
    )
    await Approver(access, conn).serve(interval)
