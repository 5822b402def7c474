"""The demo's cluster phase, after the takeover: the node image (the cached
build or a new one), an installation request per taken-over machine from
the demo's image server, the approver, the wait until every installed node
is healthy, and ConsensusMember for `CONSENSUS_GRANTS` of them.
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import trio

import bmdb
from bmdb.model import InstallState, Queries
from common.backoff import ExponentialBackoff, Retrier
from metropolis.consensus.client import Client, Member
from metropolis.consensus.process import SOCKET_NAME
from metropolis.errors import MetropolisError
from metropolis.image.build import IMAGE_SUFFIX
from metropolis.image.cache import cache_dir, cached_image
from metropolis.owner import NodeRow
from metropolis.proto import parameters
from shepherd.agent_server.images import ImageServerConfig, serve_images
from shepherd.approver import run_approver
from shepherd.demo import CONSENSUS_GRANTS as CONSENSUS_GRANTS
from shepherd.demo import FIRST_NODE_ADDRESS as FIRST_NODE_ADDRESS
from shepherd.demo_takeover import Outcome, Progress, outcomes, watch_takeover
from shepherd.demo_workdir import STOP_GRACE
from shepherd.errors import ShepherdError
from shepherd.install import Plan, check_image, image_from_server, install, owner_public_key
from shepherd.localcluster import FirstNode
from shepherd.localfleet import DISK

logger = logging.getLogger("shepherd.demo_cluster")


class DemoFailed(ShepherdError):
    """A step of the demo failed (the image build, the web UI); everything was stopped."""


def default_image_cache() -> Path:
    """``$XDG_CACHE_HOME/metropolis-images`` (``~/.cache/...`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base, "metropolis-images")


async def node_image(cache: Path, etcd: Path) -> Path:
    """The node image of today's inputs: the cached build, or a new build
    (``python -m metropolis image build``, in a session of its own, stopped
    with SIGINT if cancelled so that it removes its temporary files)."""
    folder = await trio.to_thread.run_sync(cache_dir, cache, etcd, abandon_on_cancel=True)
    found = cached_image(folder)
    if found is not None:
        logger.info(
            "progress: node image: reusing the cached build %s (%.1f MiB)",
            found,
            found.stat().st_size / 2**20,
        )
        return found
    folder.mkdir(parents=True, exist_ok=True)
    logger.info("progress: node image: building into %s (python -m metropolis image build)", folder)
    started = time.monotonic()

    async def interrupt(process: trio.Process) -> None:
        process.send_signal(signal.SIGINT)
        with trio.move_on_after(STOP_GRACE):
            await process.wait()
            return
        process.kill()

    argv = [sys.executable, "-m", "metropolis", "image", "build", "--out", str(folder)]
    result = await trio.run_process(
        [*argv, "--etcd", str(etcd)],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        start_new_session=True,
        deliver_cancel=interrupt,
    )
    found = cached_image(folder)
    if result.returncode != 0 or found is None:
        said = result.stderr.decode(errors="replace").strip().splitlines()
        raise DemoFailed(f"the node image build failed: {said[-1] if said else result.returncode}")
    logger.info(
        "progress: node image: built %s (%.1f MiB) in %.1f s",
        found.name,
        found.stat().st_size / 2**20,
        time.monotonic() - started,
    )
    return found


@dataclass(frozen=True)
class Machine:
    """A taken-over machine, as the install path tracks it."""

    provider_id: str
    machine_id: str
    #: Its own loopback address: its node's address too.
    address: str


@dataclass
class Seen:
    """What the whole path has seen so far (the final table shows it)."""

    results: list[Outcome]
    machines: dict[str, Machine]
    installs: dict[str, str]
    nodes: dict[str, NodeRow]


async def whole_path(
    conn: bmdb.Connection,
    first: FirstNode,
    expected: dict[str, bool],
    progress: Progress,
    deadline: float,
    image: list[Path],
    image_ready: trio.Event,
) -> tuple[bool, Seen]:
    """Takeover, install, approval, roles, bounded by ``deadline``: whether
    every machine ended as expected, and what was seen."""
    seen = Seen([], {}, {}, {})
    finished = False
    # Its own nursery: the image server and the approver stop before the first node does.
    async with trio.open_nursery() as servers:
        with trio.move_on_at(deadline):
            finished = await _steps(
                conn,
                servers,
                first,
                expected,
                progress,
                image,
                image_ready,
                seen,
            )
        servers.cancel_scope.cancel()
    with trio.move_on_after(5):
        seen.results = await outcomes(conn)
        seen.nodes = await _nodes(first, seen.nodes)
    return finished, seen


async def _steps(
    conn: bmdb.Connection,
    nursery: trio.Nursery,
    first: FirstNode,
    expected: dict[str, bool],
    progress: Progress,
    image: list[Path],
    image_ready: trio.Event,
    seen: Seen,
) -> bool:
    taken_over, seen.results = await watch_takeover(conn, expected, progress)
    if not taken_over:
        return False
    if not image_ready.is_set():
        logger.info("progress: waiting for the node image")
    await image_ready.wait()
    images = await nursery.start(serve_images, ImageServerConfig("127.0.0.1:0", image[0].parent))
    digest = "sha256:" + image[0].name.removesuffix(IMAGE_SUFFIX)
    plan = await _plan(first, images, digest)
    await check_image(plan.image, ssl.create_default_context())
    seen.machines = await _taken_over(conn, [p for p, good in expected.items() if good])
    by_machine = {m.machine_id: m for m in seen.machines.values()}
    decisions = await install(conn, plan, machines=[uuid.UUID(m) for m in by_machine])
    refused = [d for d in decisions if d.refused is not None]
    for d in refused:
        logger.error(
            "install refused for %s: %s", by_machine[str(d.machine_id)].provider_id, d.refused
        )
    if refused:
        return False
    logger.info(
        "progress: install requested for %d machines: image %s from %s, root device %s",
        len(decisions),
        digest,
        images,
        plan.root_device,
    )
    nursery.start_soon(run_approver, first.access, conn, 0.5)

    # Installed, registered, approved (by the approver), joined and healthy.
    while True:
        seen.installs = await _install_states(conn, seen.machines)
        seen.nodes = await _nodes(first, seen.nodes)
        for provider_id, state in seen.installs.items():
            progress.show(provider_id, state)
        for row in seen.nodes.values():
            progress.show(f"node {row.node_id} ({row.address or '-'})", _node_state(row))
        if any(state.startswith("install failed") for state in seen.installs.values()):
            return False
        if all(_healthy(seen.nodes.get(m.address)) for m in seen.machines.values()):
            break
        await trio.sleep(0.5)

    # ConsensusMember for the first machines' nodes, one at a time (etcd
    # takes one new member at a time): each becomes an etcd voter.
    chosen = [seen.nodes[m.address] for m in seen.machines.values()][:CONSENSUS_GRANTS]
    for row in chosen:
        await _grant_consensus(first, row)
        # Polling: the state lives in other processes.
        while not await _votes(first, row, seen, progress):  # noqa: ASYNC110
            await trio.sleep(0.5)
    # Every node healthy at once: a heartbeat may be missed while curators
    # start on the new members.
    while True:
        seen.nodes = await _nodes(first, seen.nodes)
        for node in seen.nodes.values():
            progress.show(f"node {node.node_id} ({node.address or '-'})", _node_state(node))
        if all(_healthy(seen.nodes.get(m.address)) for m in seen.machines.values()):
            return True
        await trio.sleep(0.5)


#: Waits after a refused role change (etcd busy with the last new member).
_GRANT_BACKOFF = ExponentialBackoff(initial=0.5, maximum=5.0)


async def _grant_consensus(first: FirstNode, row: NodeRow) -> None:
    """Grant ConsensusMember to ``row``'s node, retrying refusals with backoff
    (the caller bounds it)."""
    retrier = Retrier(_GRANT_BACKOFF)
    while True:
        try:
            async with first.access.open() as owner:
                await owner.set_roles(row.node_id, consensus_member=True)
        except MetropolisError as e:
            logger.info("progress: ConsensusMember for %s not granted yet: %s", row.node_id, e)
            await retrier.sleep()
            continue
        logger.info("progress: ConsensusMember granted to %s (%s)", row.node_id, row.address)
        return


async def _votes(first: FirstNode, row: NodeRow, seen: Seen, progress: Progress) -> bool:
    """Whether ``row``'s node is an etcd voter, has the role and is healthy
    (saying what changed in etcd's membership)."""
    members = await _members(first)
    seen.nodes = await _nodes(first, seen.nodes)
    for member in members:
        if member.name:
            progress.show(f"etcd member {member.name}", "learner" if member.is_learner else "voter")
    now = seen.nodes.get(row.address)
    voting = any(m.name == row.node_id and not m.is_learner for m in members)
    return voting and now is not None and "ConsensusMember" in now.roles and _healthy(now)


async def _plan(first: FirstNode, images: str, digest: str) -> Plan:
    """What each machine is asked to install: register into ``first``'s
    cluster with its ticket, for its owner, from the demo's image server."""
    async with first.access.open() as owner:
        ticket = await owner.ticket()
    owner_key = owner_public_key(first.owner_key.read_bytes(), str(first.owner_key))
    params = parameters.register_parameters(first.info, ticket, owner_key)
    return Plan(
        node_parameters=parameters.encode(params),
        # Plain HTTP, as the agents' endpoint: the agents verify the digest.
        image=image_from_server(images, digest, plain_http=True),
        root_device=DISK.name,
    )


async def _taken_over(conn: bmdb.Connection, provider_ids: list[str]) -> dict[str, Machine]:
    """The BMDB's ids and the addresses of the machines ``provider_ids``, in that order."""
    rows = await conn.transact(lambda q: q.machines())
    found = {
        r.provided.provider_id: Machine(
            r.provided.provider_id, str(r.machine_id), str(r.provided.address)
        )
        for r in rows
        if r.provided is not None
    }
    return {p: found[p] for p in provider_ids}


async def _install_states(conn: bmdb.Connection, machines: dict[str, Machine]) -> dict[str, str]:
    """Each machine's installation as the BMDB shows it, in words."""

    async def fn(q: Queries) -> dict[str, str]:
        states = {}
        for provider_id, machine in machines.items():
            got = await q.os_installation(machine.machine_id)
            if got is None:
                states[provider_id] = "not requested"
            elif got.state is InstallState.INSTALLED:
                states[provider_id] = f"installed (generation {got.generation}), node {got.node_id}"
            elif got.state is InstallState.INSTALL_FAILED:
                states[provider_id] = f"install failed: {got.cause}"
            elif got.state is InstallState.INSTALL_LOST:
                states[provider_id] = f"install lost: {got.lost_cause}"
            else:
                states[provider_id] = f"installing generation {got.generation}"
        return states

    return await conn.transact(fn, isolation=bmdb.Isolation.REPEATABLE_READ)


async def _nodes(first: FirstNode, before: dict[str, NodeRow]) -> dict[str, NodeRow]:
    """The cluster's nodes by address; ``before`` while the curators do not
    answer (a leader changing, a curator starting)."""
    try:
        async with first.access.open() as owner:
            return {row.address: row for row in await owner.nodes() if row.address}
    except MetropolisError as e:
        logger.debug("the curators did not answer: %s", e)
        return before


async def _members(first: FirstNode) -> list[Member]:
    """etcd's members, from the first node's etcd; none while it does not answer."""
    try:
        async with Client(first.root.ephemeral.consensus / SOCKET_NAME) as etcd:
            members: list[Member] = await etcd.member_list()
            return members
    except MetropolisError as e:
        logger.debug("etcd did not answer: %s", e)
        return []


def _healthy(row: NodeRow | None) -> bool:
    return row is not None and row.state == "UP" and row.health == "HEALTHY"


def _node_state(row: NodeRow) -> str:
    roles = ",".join(row.roles) or "no roles"
    return f"{row.state}, {row.health}, {roles}"
