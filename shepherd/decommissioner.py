"""The decommissioner: wipe machines an operator asked to decommission,
release them to their provider, and leave a tombstone.

A control loop processor (see :mod:`shepherd.control_loop`) under the BMDB
process ``ShepherdDecommission``; an operator asks with ``python -m bmdb
decommission MACHINE --reason ...`` (audited), and from then on no other
process is offered the machine::

    source (in the claiming transaction)
      machines_for_decommission(1)        requested, not done, not held
    handle
      a cluster node, not removed yet:    the current successful install report
                                          names the node's key
        no owner credentials              ──▶ fail: "is cluster node X; no owner
                                              credentials to remove it"
        owner.nodes()                     not listed: nothing to remove
        owner.set_roles(all off)          if it holds roles
        owner.delete(node)                ──RPC error──▶ tried again through
                                              common.backoff, then fail (backoff)
        record_node_removal(detail)       one transaction of its own
      not wiped yet:
        no pinned SSH host key            ──▶ fail: a wipe dials only a machine
                                              that proved its key at a takeover
        provider.get_machine(id)          ──ProviderError──▶ fail (backoff)
        ssh <address> '<agent> --wipe'    ──SSH error, agent error──▶ fail
          the agent stops itself and the installed nodes, empties the
          loopback disks, wipes an installed real disk, removes its key,
          prints what it did (JSON, a real disk's steps each with its
          outcome, which the stored report lists)
        record_wipe(report)               one transaction of its own
      not released yet:
        a node not removed yet            an install report stored after the
                                          source read: removed as above (the
                                          wipe stopped it; nothing registers now)
        provider.release(id)              ──ProviderError──▶ fail (backoff)
          Equinix: the device is deleted; static: marked removed
        record_release(detail)            one transaction of its own
      finish: tombstone                   decommissioned_at; agent tags cleared

Each step is recorded before the next starts, so a retry (after a failure,
a crash, a lost session) resumes where it stopped: a machine is never
released before its wipe is reported (the BMDB's CHECKs hold that too), and
a wipe already reported is not run again, and a node whose removal is
recorded is not looked for again. A machine is wiped only once the cluster
node it runs is gone from the cluster: a wiped node the cluster still
lists would hold its roles (an etcd voter among them) while dead.

The owner's credentials (`metropolis.owner.OwnerAccess`, what the
approver uses: ``python -m shepherd --cluster-owner-root DIR`` or
``--cluster-owner-info FILE``, with ``--cluster-owner-key FILE``) are
needed only for machines that are nodes; without them such a machine
waits, its cause in the views, until the Shepherd is started with them
(then ``python -m bmdb retry-now`` ends the wait). A node that the
cluster no longer lists (removed by an earlier try whose record was lost,
or never registered) counts as removed. The node is matched by its
public key, never by address.
"""

from __future__ import annotations

import json
import logging
import shlex
import uuid

import trio

from bmdb import Backoff, Process, Queries, Work
from bmdb.model import DecommissionTarget, node_id
from common.backoff import ExponentialBackoff, Retrier
from common.text import printable
from metropolis.errors import MetropolisError
from metropolis.owner import OwnerAccess, describe_change
from shepherd.control_loop import ProcessingFailed
from shepherd.providers import Provider, ProviderError
from shepherd.ssh import SSHClient, SSHError

logger = logging.getLogger("shepherd.decommissioner")

#: A failed step is tried again after 1 minute, growing by x2 up to 1 hour.
DEFAULT_BACKOFF = Backoff(initial=60, maximum=3600, exponent=2)

#: Bound on the stored wipe report's length (the BMDB takes 4096 characters).
WIPE_REPORT_LIMIT = 3000

#: Bound on the SSH session of a wipe (connect, run, stop the node).
DEFAULT_WIPE_TIMEOUT = 120.0

#: Tries of a node's removal within one work, and the waits between them
#: (a curator failover, a role revocation the next leader completes);
#: after the last, the work fails and the BMDB backoff takes over.
REMOVE_ATTEMPTS = 4
REMOVE_BACKOFF = ExponentialBackoff(initial=1.0, maximum=8.0)


class Decommissioner:
    """Decommissions machines; a :class:`shepherd.control_loop.Processor`."""

    component = "shepherd-decommissioner"
    process = Process.SHEPHERD_DECOMMISSION

    def __init__(
        self,
        provider: Provider,
        ssh: SSHClient,
        *,
        agent_target_path: str,
        wipe_timeout: float = DEFAULT_WIPE_TIMEOUT,
        backoff: Backoff = DEFAULT_BACKOFF,
        owner: OwnerAccess | None = None,
        remove_attempts: int = REMOVE_ATTEMPTS,
        remove_backoff: ExponentialBackoff = REMOVE_BACKOFF,
    ) -> None:
        if not wipe_timeout > 0:
            raise ValueError("the wipe timeout must be positive")
        if remove_attempts < 1:
            raise ValueError("a node removal needs at least one attempt")
        self.owner = owner
        self.remove_attempts = remove_attempts
        self.remove_backoff = remove_backoff
        self.provider = provider
        self.ssh = ssh
        self.agent_target_path = agent_target_path
        self.wipe_timeout = wipe_timeout
        self.backoff = backoff

    async def source(self, q: Queries) -> DecommissionTarget | None:
        targets = await q.machines_for_decommission(1)
        return targets[0] if targets else None

    def machine_id(self, task: DecommissionTarget) -> uuid.UUID:
        return task.machine_id

    async def handle(self, work: Work, task: DecommissionTarget) -> None:
        mid = task.machine_id
        provided = task.provided
        if provided is None:
            raise ProcessingFailed("machine has no provider tag: nothing to wipe or release")
        if provided.provider != self.provider.type:
            raise ProcessingFailed(
                f"machine is provided by {provided.provider}, "
                f"this decommissioner serves {self.provider.type}"
            )
        if not task.wiped:
            key = task.node_public_key
            if key is not None and not task.node_removed:
                await self._remove_and_record(work, mid, key)
            report = await self._wipe(mid, provided.provider_id, task.host_key)

            async def wiped(q: Queries) -> None:
                await q.record_wipe(mid, report)

            await work.transact(wiped)
            logger.info("machine %s: wiped: %s", mid, report)
        if not task.released:
            # The agent may have stored an install report after the source
            # read none (or an older one): its node registered and was
            # stopped by the wipe, and the cluster still lists it. Wiped,
            # the machine can register nothing more, so one look now finds
            # every such node; it goes before the machine is released.
            late = await work.transact(lambda q: q.unremoved_node_key(mid))
            if late is not None:
                await self._remove_and_record(work, mid, late)
            try:
                detail = await self.provider.release(provided.provider_id)
            except ProviderError as exc:
                raise ProcessingFailed(f"provider did not release the machine: {exc}") from exc

            async def released(q: Queries) -> None:
                await q.record_release(mid, printable(detail))

            await work.transact(released)
            logger.info("machine %s: released: %s", mid, detail)

        async def tombstone(q: Queries) -> None:
            await q.tombstone(mid)

        await work.finish(tombstone)
        logger.info("machine %s: decommissioned", mid)

    async def _remove_and_record(self, work: Work, mid: uuid.UUID, key: bytes) -> None:
        """Remove the node of ``key`` from its cluster, and record that."""
        removal = await self._remove_node(key)

        async def removed(q: Queries) -> None:
            await q.record_node_removal(mid, node_id(key), removal)

        await work.transact(removed)
        logger.info("machine %s: %s", mid, removal)

    async def _remove_node(self, key: bytes) -> str:
        """Remove the node of ``key`` from the cluster (roles revoked, then
        deleted); what changed, in one line. Tries `remove_attempts` times
        through `remove_backoff`, then fails the work with the last error."""
        node = node_id(key)
        if self.owner is None:
            raise ProcessingFailed(
                f"is cluster node {node}; no owner credentials to remove it (start the "
                "Shepherd with --cluster-owner-key and --cluster-owner-root or "
                "--cluster-owner-info)"
            )
        retrier = Retrier(self.remove_backoff)
        while True:
            try:
                return await self._delete(self.owner, node, key)
            except MetropolisError as exc:
                if retrier.failures + 1 >= self.remove_attempts:
                    raise ProcessingFailed(
                        f"is cluster node {node}; removing it failed "
                        f"{retrier.failures + 1} time(s): {printable(str(exc))}"
                    ) from exc
                logger.warning("removing cluster node %s failed, trying again: %s", node, exc)
                await retrier.sleep()

    async def _delete(self, access: OwnerAccess, node: str, key: bytes) -> str:
        async with access.open() as owner:
            row = next((r for r in await owner.nodes() if r.public_key == key), None)
            if row is None:
                return f"cluster node {node} is not listed by the cluster: nothing to remove"
            done = []
            if row.roles:
                change = await owner.set_roles(
                    row.node_id,
                    consensus_member=False if "ConsensusMember" in row.roles else None,
                    kubernetes_controller=False if "KubernetesController" in row.roles else None,
                )
                done.append(describe_change(change))
            done.append(describe_change(await owner.delete(row.node_id)))
            return printable("removed from the cluster: " + "; ".join(done))

    async def _wipe(self, mid: uuid.UUID, provider_id: str, host_key: bytes | None) -> str:
        """Run ``agent --wipe`` on the machine; its report as one line."""
        if host_key is None:
            raise ProcessingFailed(
                "no pinned SSH host key: a wipe dials only a machine that proved its key "
                "at a takeover"
            )
        try:
            machine = await self.provider.get_machine(provider_id)
        except ProviderError as exc:
            raise ProcessingFailed(f"failed to fetch machine from provider: {exc}") from exc
        if not machine.address:
            raise ProcessingFailed(f"machine has no address (provider id {provider_id!r})")
        command = f"{shlex.quote(self.agent_target_path)} --wipe"
        result = None
        with trio.move_on_after(self.wipe_timeout):
            try:
                async with self.ssh.connect(
                    machine.address, machine.port, known_host_key=host_key
                ) as conn:
                    result = await conn.run(command)
            except SSHError as exc:
                raise ProcessingFailed(f"wipe: {exc}") from exc
        if result is None:
            raise ProcessingFailed(f"wipe timed out after {self.wipe_timeout:g}s")
        stdout = result.stdout.decode("utf-8", errors="replace").strip()
        try:
            report = json.loads(stdout.splitlines()[-1]) if stdout else None
        except ValueError:
            report = None
        if not isinstance(report, dict) or not all(
            isinstance(report.get(k), list) for k in ("wiped", "stopped", "errors")
        ):
            stderr = result.stderr.decode("utf-8", errors="replace").strip()
            raise ProcessingFailed(
                f"wipe: the agent gave no report (exit status {result.exit_status}): "
                f"{printable(stderr or stdout)[:500]}"
            )
        steps = report.get("steps")
        steps = steps if isinstance(steps, list) else []  # an older agent's has none
        if report["errors"] or result.exit_status != 0:
            raise ProcessingFailed(
                f"wipe failed: {printable('; '.join(map(str, report['errors'])))}"
                + (f" (steps: {printable('; '.join(map(str, steps)))})" if steps else "")
            )
        return printable(
            f"stopped {len(report['stopped'])} process(es), removed {len(report['wiped'])} "
            f"path(s): {', '.join(map(str, report['wiped']))}"
            + (f"; {'; '.join(map(str, steps))}" if steps else ""),
            WIPE_REPORT_LIMIT,
        )
