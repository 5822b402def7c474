"""``python -m shepherd upgrade``: a rolling upgrade of installed machines to a new node image.

Starting a run writes, in ONE SERIALIZABLE transaction, an ``upgrade_run``
(the image, ``--max-unavailable``, ``--health-timeout``) and a row per
machine, pending, in the order the cluster gives them (when the owner's
credentials are given: nodes without a consensus role first, then
consensus members, the leader's node last; the Shepherd's upgrader checks
that order against the cluster again before each machine), and an audit
record for the run and for each machine. The Shepherd's upgrader
(:mod:`shepherd.upgrader`, in ``python -m shepherd`` with the owner's
credentials) then does the work, from any Shepherd process, across
restarts; this command only asks, and with ``--wait`` follows::

    python -m shepherd upgrade --bmdb-url URL \\
        --image-server https://HOST:PORT --image-digest sha256:HEX | --image-url URL
        [--image-server-ca FILE] [--insecure-plain-http]
        --machines ID[,ID...] | --all
        [--max-unavailable 1] [--health-timeout 300]
        [--cluster-owner-key FILE (--cluster-owner-root DIR | --cluster-owner-info FILE)]
        [--operator NAME] [--reason TEXT] [--dry-run] [--wait]
    python -m shepherd upgrade --bmdb-url URL --status
    python -m shepherd upgrade --bmdb-url URL --stop --reason TEXT

Refused, with one line each and nothing written for it, is a machine that
is not installed (no successful installation with a node key), is held,
or is being decommissioned; a machine whose node already runs the image
(as far as the BMDB knows) is left out. The whole run is refused (exit 1)
if the image server does not have the image, if no machine is left, or if
another run is not finished (one run at a time). ``--wait`` prints each
machine's changes until the run ends; its exit status is 0 when every
machine was upgraded, 1 when the run stopped (the cause is printed: the
first machine that went back, and why). Interrupting ``--wait`` leaves the
run going: the Shepherd does the work.
"""

from __future__ import annotations

import argparse
import getpass
import logging
import ssl
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

import bmdb
from bmdb.errors import BMDBError, InvalidArgument
from bmdb.model import (
    InstallState,
    MachineUpgrade,
    Queries,
    UpgradePlanEntry,
    UpgradeRun,
)
from common.cli import run_trio_command
from common.text import printable
from metropolis.errors import MetropolisError
from shepherd.errors import ShepherdError
from shepherd.install import ImageRef, check_image, image_from_args
from shepherd.proto.agent_callback import UpgradeRequest
from shepherd.upgrade_options import DEFAULT_HEALTH_TIMEOUT
from shepherd.upgrade_plan import phase

if TYPE_CHECKING:  # the owner's client is imported only when credentials are given
    from metropolis.owner import NodeRow, OwnerAccess

logger = logging.getLogger("shepherd.upgrade")

PHASES = ("workers", "consensus", "leader")


class UpgradeError(ShepherdError):
    """A run refused as a whole (the image, no machine, another run): nothing written."""


@dataclass(frozen=True)
class Choice:
    """What the command does with one machine."""

    machine_id: uuid.UUID
    entry: UpgradePlanEntry | None = None
    #: Why it is left out (refused, or already on the image).
    left_out: str | None = None
    node: str = "-"


def _order_key(row: NodeRow | None) -> int:
    return 0 if row is None else phase(row)


async def choose(
    q: Queries,
    machines: Sequence[uuid.UUID],
    digest: str,
    cluster: list[NodeRow] | None,
) -> list[Choice]:
    """Each machine's place in the run, or why it is left out, from one snapshot."""
    ids = list(dict.fromkeys(machines)) if machines else await q.installed_machine_ids()
    latest = await q.latest_upgrades()
    by_key = {r.public_key: r for r in cluster or []}
    found: list[tuple[uuid.UUID, UpgradePlanEntry | None, str | None, NodeRow | None]] = []
    for mid in ids:
        target = await q.installation_target(mid)
        installation = target.installation if target is not None else None
        if target is None:
            found.append((mid, None, "no such machine", None))
            continue
        if target.held is not None:
            found.append((mid, None, f"held by {target.held}", None))
            continue
        if target.decommissioned:
            found.append((mid, None, "it is being decommissioned, or was", None))
            continue
        if (
            installation is None
            or installation.state is not InstallState.INSTALLED
            or installation.node_public_key is None
            or not installation.root_device
        ):
            found.append((mid, None, "not installed (no successful installation)", None))
            continue
        row = by_key.get(installation.node_public_key)
        last = latest.get(mid)
        current = (last.running_digest if last is not None else None) or installation.image_digest
        if row is not None and row.image:
            current = row.image
        if current == digest:
            found.append((mid, None, f"already runs {digest[:19]}", row))
            continue
        entry = UpgradePlanEntry(mid, _order_key(row), 0, installation.root_device, current)
        found.append((mid, entry, None, row))
    planned = [(mid, entry, row) for mid, entry, _, row in found if entry is not None]
    planned.sort(key=lambda p: p[1].phase)  # stable: the given order within a phase
    choices = [
        Choice(
            mid,
            UpgradePlanEntry(mid, entry.phase, position, entry.root_device, entry.from_digest),
            node=row.node_id if row else "-",
        )
        for position, (mid, entry, row) in enumerate(planned)
    ]
    choices += [
        Choice(mid, left_out=why, node=row.node_id if row else "-")
        for mid, entry, why, row in found
        if entry is None
    ]
    return choices


@dataclass(frozen=True)
class Options:
    bmdb_url: str
    action: str  # "start", "status", "stop"
    image: ImageRef | None = None
    ssl_context: ssl.SSLContext | None = None
    machines: tuple[uuid.UUID, ...] = ()
    max_unavailable: int = 1
    health_timeout: int = DEFAULT_HEALTH_TIMEOUT
    owner: OwnerAccess | None = None
    operator: str = ""
    reason: str = ""
    dry_run: bool = False
    wait: bool = False
    verbose: bool = False


def write_request(
    run: UpgradeRun, root_device: str, generation: int, *, activate: bool = False
) -> bytes:
    """The serialized UpgradeRequest of ``run`` for a machine: write the image
    to the inactive slot, and with ``activate`` try it at once."""
    return bytes(
        UpgradeRequest(
            generation=generation,
            os_image=run.os_image,
            health_timeout_seconds=run.health_timeout,
            root_device=root_device,
            activate=activate,
        )
    )


async def ask_writes(q: Queries, run: UpgradeRun, entries: Sequence[UpgradePlanEntry]) -> None:
    """Ask every machine of the new ``run`` (``entries``, as it was created
    with) to write the image to its inactive slot now, all at once: a write
    takes no node down, so the per-node downtime the upgrader causes later
    (one machine at a time: activate, reboot, health) excludes the download
    and the write. Each machine gets its next generation; the upgrader
    activates that same generation."""
    for entry in entries:
        generation = await q.next_upgrade_generation(entry.machine_id)
        request = write_request(run, entry.root_device, generation)
        await q.write_upgrade(run.run_id, entry.machine_id, generation, request)


@dataclass(frozen=True)
class Planned:
    """What `create_run` did: each machine's choice, the run written (None on
    a dry run), and whether the cluster's view ordered it."""

    choices: list[Choice]
    run: UpgradeRun | None
    ordered: bool


async def create_run(conn: bmdb.Connection, options: Options) -> Planned:
    """Check the image, choose the machines, write the run (unless a dry run)
    and its audit records in one SERIALIZABLE transaction. UpgradeError
    (nothing written) when the image server lacks the image, the cluster
    does not answer, or another run is not finished; no run either (and no
    error) when no machine is left (each choice says why)."""
    assert options.image is not None and options.ssl_context is not None
    await check_image(options.image, options.ssl_context)
    cluster = None
    if options.owner is not None:
        try:
            async with options.owner.open() as owner:
                cluster = await owner.nodes()
        except MetropolisError as exc:
            raise UpgradeError(f"cannot read the cluster's nodes: {exc}") from exc
    digest = options.image.digest

    async def body(q: Queries) -> tuple[list[Choice], UpgradeRun | None]:
        choices = await choose(q, options.machines, digest, cluster)
        entries = [c.entry for c in choices if c.entry is not None]
        if not entries or options.dry_run:
            return choices, None
        run = await q.create_upgrade_run(
            image_digest=digest,
            os_image=bytes(options.image.message()) if options.image else b"",
            max_unavailable=options.max_unavailable,
            health_timeout=options.health_timeout,
            requested_by=options.operator,
            machines=entries,
        )
        await q.append_audit(
            options.operator,
            "upgrade",
            None,
            options.reason,
            f"run {run.run_id}: {len(entries)} machine(s) to {digest}",
        )
        for entry in entries:
            await q.append_audit(
                options.operator,
                "upgrade",
                entry.machine_id,
                options.reason,
                f"run {run.run_id}: to {digest}, {PHASES[entry.phase]} #{entry.position + 1}",
            )
        await ask_writes(q, run, entries)
        return choices, run

    try:
        choices, run = await conn.transact(body, isolation=bmdb.Isolation.SERIALIZABLE)
    except InvalidArgument as exc:
        raise UpgradeError(str(exc)) from exc
    return Planned(choices, run, cluster is not None)


async def start(conn: bmdb.Connection, options: Options) -> int:
    """`create_run`, then print the plan (and with ``--wait`` follow the run)."""
    planned = await create_run(conn, options)
    choices, run, digest = (
        planned.choices,
        planned.run,
        options.image.digest if options.image else "",
    )
    for c in choices:
        if c.entry is not None:
            print(
                f"{'would upgrade' if options.dry_run else 'upgrade'} #{c.entry.position + 1} "
                f"{c.machine_id} node {c.node} ({PHASES[c.entry.phase]}) from "
                f"{(c.entry.from_digest or '?')[:19]}"
            )
        else:
            print(printable(f"left out {c.machine_id}: {c.left_out}"))
    count = sum(c.entry is not None for c in choices)
    if not count:
        raise UpgradeError("no machine to upgrade")
    if run is None:
        print(f"{count} machine(s) would be upgraded to {digest} (dry run: nothing written)")
        return 0
    print(
        f"upgrade run {run.run_id}: {count} machine(s) to {digest}, at most "
        f"{run.max_unavailable} at a time, {run.health_timeout} s for each node to be healthy"
        + ("" if planned.ordered else " (order: the Shepherd's upgrader sets it)")
    )
    if not options.wait:
        print(
            "the Shepherd's upgrader does the work; follow it: python -m shepherd upgrade --status"
        )
        return 0
    return await follow(conn, run.run_id)


async def follow(conn: bmdb.Connection, run_id: uuid.UUID, *, interval: float = 1.0) -> int:
    """Print each machine's changes until the run ends; 0 if all were upgraded."""
    seen: dict[uuid.UUID, tuple[str, str | None, str | None]] = {}
    while True:

        async def body(q: Queries) -> tuple[UpgradeRun | None, list[MachineUpgrade]]:
            return await q.upgrade_run(run_id), [m for m, _ in await q.upgrade_machines(run_id)]

        run, machines = await conn.transact(body)
        assert run is not None
        for m in machines:
            now = (str(m.state), m.agent_state, m.detail)
            if seen.get(m.machine_id) != now:
                seen[m.machine_id] = now
                print(printable(machine_line(m)), flush=True)
        if run.finished_at is not None:
            if run.stop_cause:
                print(printable(f"upgrade run {run_id} stopped: {run.stop_cause}"))
                return 1
            print(f"upgrade run {run_id} finished: every machine runs {run.image_digest}")
            return 0
        await trio.sleep(interval)


def machine_line(m: MachineUpgrade) -> str:
    """One machine of a run, on one line."""
    agent = f"; agent: {m.agent_state} {m.agent_detail or ''}".rstrip() if m.agent_state else ""
    where = f" slot {m.slot} {m.running_digest[:19]}" if m.running_digest and m.slot else ""
    detail = f": {m.detail}" if m.detail else ""
    return f"{m.machine_id} {m.state}{where} ({PHASES[m.phase]} #{m.position + 1}){detail}{agent}"


async def status(conn: bmdb.Connection) -> int:
    async def body(q: Queries) -> tuple[list[UpgradeRun], list[MachineUpgrade]]:
        runs = await q.upgrade_runs(1)
        machines = [m for m, _ in await q.upgrade_machines(runs[0].run_id)] if runs else []
        return runs, machines

    runs, machines = await conn.transact(body)
    if not runs:
        print("no upgrade run yet")
        return 0
    run = runs[0]
    state = (
        "running"
        if run.finished_at is None
        else (f"stopped: {run.stop_cause}" if run.stop_cause else "finished")
    )
    print(
        printable(
            f"upgrade run {run.run_id} to {run.image_digest}, by {run.requested_by} at "
            f"{run.requested_at:%Y-%m-%d %H:%M:%S}: {state}"
        )
    )
    for m in machines:
        print(printable("  " + machine_line(m)))
    return 0


async def stop(conn: bmdb.Connection, options: Options) -> int:
    async def body(q: Queries) -> UpgradeRun | None:
        run = await q.running_upgrade_run()
        if run is None:
            return None
        cause = f"stopped by {options.operator}: {options.reason}"
        await q.stop_upgrade_run(run.run_id, cause)
        await q.append_audit(
            options.operator, "upgrade-stop", None, options.reason, f"run {run.run_id} stopped"
        )
        return run

    run = await conn.transact(body, isolation=bmdb.Isolation.SERIALIZABLE)
    if run is None:
        raise UpgradeError("no upgrade run is running")
    print(
        f"upgrade run {run.run_id} stopped: no machine is asked from now on (one being "
        "upgraded now ends as its node and agent make it)"
    )
    return 0


async def run(options: Options) -> int:
    async with bmdb.open_connection(options.bmdb_url, max_connections=1) as conn:
        if options.action == "status":
            return await status(conn)
        if options.action == "stop":
            return await stop(conn, options)
        return await start(conn, options)


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Options:
    """Check ``args`` (parsed by ``parser``: `shepherd.upgrade_options.build_parser`)
    together, load the image server's CA and the owner's credentials; exit
    with status 2 on any problem."""
    operator = args.operator
    if operator is None:
        try:
            operator = getpass.getuser()
        except (OSError, KeyError):
            parser.error("cannot tell the OS user's name: give --operator NAME")
    if args.status:
        return Options(args.bmdb_url, "status")
    reason = args.reason.strip()
    if args.stop:
        if not reason:
            parser.error("--stop needs --reason TEXT (for the audit log)")
        return Options(args.bmdb_url, "stop", operator=operator, reason=reason)
    machines = tuple(m for group in args.machines for m in group)
    if bool(machines) == args.all:
        parser.error("choose machines with --machines ID[,ID...] or --all")
    image = image_from_args(parser, args)
    try:
        context = ssl.create_default_context(
            cafile=None if args.image_server_ca is None else str(args.image_server_ca)
        )
    except (OSError, ssl.SSLError) as e:
        parser.error(f"argument --image-server-ca: {args.image_server_ca}: {e}")
    owner = None
    where = [p for p in (args.cluster_owner_root, args.cluster_owner_info) if p is not None]
    if len(where) > 1:
        parser.error("--cluster-owner-root and --cluster-owner-info exclude each other")
    if bool(where) != (args.cluster_owner_key is not None):
        parser.error("--cluster-owner-key goes with --cluster-owner-root or --cluster-owner-info")
    if where:
        from metropolis.localstorage import Root
        from metropolis.owner import load_owner, load_owner_from_cluster, load_owner_key

        try:
            key = load_owner_key(args.cluster_owner_key)
            owner = (
                load_owner(Root(args.cluster_owner_root.resolve()), key)
                if args.cluster_owner_root is not None
                else load_owner_from_cluster(args.cluster_owner_info.resolve(), key)
            )
        except MetropolisError as e:
            parser.error(f"the cluster owner's credentials: {e}")
    return Options(
        args.bmdb_url,
        "start",
        image=image,
        ssl_context=context,
        machines=machines,
        max_unavailable=args.max_unavailable,
        health_timeout=args.health_timeout,
        owner=owner,
        operator=operator,
        reason=reason or f"rolling upgrade to {image.digest}",
        dry_run=args.dry_run,
        wait=args.wait,
        verbose=args.verbose,
    )


def run_parsed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Check ``args`` (parsed by ``parser``) and run; the exit status."""
    options = check_options(parser, args)
    known = (BMDBError, ShepherdError, MetropolisError)
    return run_trio_command("shepherd upgrade", run, options, verbose=options.verbose, known=known)
