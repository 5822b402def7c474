"""``python -m shepherd``: run the Shepherd's loops against a BMDB and a provider.

Every option is checked (files read, certificates and keys parsed, rates and
durations parsed, Equinix names free of ``FIXME``) before anything starts; a
bad or missing option exits with status 2 and a message naming it. Then::

    trio.run ─ bmdb.open_connection(url) ─ trio_asyncio loop (for asyncssh)
                                           ├─ (equinix) ensure the SSH key under its label
                                           ├─ provisioner.run    (reconcile, create)
                                           ├─ updater.run        (unless --no-updater-enable)
                                           ├─ run_control_loop(initializer, N workers)
                                           ├─ run_control_loop(recoverer, M workers)
                                           ├─ run_control_loop(decommissioner, 1 worker)
                                           ├─ run_control_loop(upgrader, 4 workers)
                                           └─ pruner.run         (with a retention policy)

The BMDB needs no asyncio loop, so it is opened first, outside it: an
unreachable or malformed ``--bmdb-url`` then fails as one plain
`DatabaseUnavailable` (one line on stderr, exit status 1) rather than from
inside the loop's nursery.

``--provider static`` reads ``--static-machines-path`` (machines may name a
Redfish BMC; credentials from ``--static-bmc-credentials-path`` or
``SHEPHERD_BMC_USERNAME``/``SHEPHERD_BMC_PASSWORD``). ``--provider equinix``
talks to the Equinix Metal API with the token of ``--equinix-api-token`` or
``METAL_AUTH_TOKEN``. A provider that refuses us at start (bad token, unknown
project) ends the process with status 1 and the API's message.

The agent callback server, which receives the heartbeats the recoverer
watches, is its own process: ``python -m shepherd.agent_server``.

``--cluster-owner-key FILE`` with ``--cluster-owner-root DIR`` (a node's
root) or ``--cluster-owner-info FILE`` (what ``metropolis owner info --out``
writes) gives the cluster owner's credentials (what ``python -m metropolis
owner`` takes). With them the decommissioner removes a machine's cluster
node from the cluster before the wipe (without, such a machine's
decommission waits, saying why), the upgrader (:mod:`shepherd.upgrader`)
moves the machines of a rolling upgrade run to their new image (without,
they wait, saying why), and ``--approve-installed`` (which needs
them) also runs the approver (:mod:`shepherd.approver`): it approves the
cluster's NEW nodes whose key a machine's agent reported in a successful
installation, every ``--approve-interval``.

``--retention-keep-last N --retention-keep-newer-than AGE`` (both, or
neither) runs the pruner (:mod:`shepherd.pruner`, off by default: it says
why): every ``--retention-interval`` it deletes the work history and audit
records older than AGE beyond each machine's newest N.

SIGINT or SIGTERM cancels the loop: work in flight is canceled in the BMDB,
sessions are deleted, and the process exits with status 0.

``python -m shepherd install ...`` is a separate command, which asks
machines to install the node image (see `shepherd.install`); so is
``python -m shepherd upgrade ...``, which starts a rolling upgrade run (see
`shepherd.upgrade`).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio_asyncio
from prometheus_client import CollectorRegistry

import bmdb
from bmdb.errors import BMDBError
from bmdb.metrics import DEFAULT_FLEET_PERIOD, ConnectionCollector, FleetGauges
from bmdb.model import AGENT_FIRST_HEARTBEAT_TIMEOUT, AGENT_HEARTBEAT_TIMEOUT
from bmdb.retention import RetentionPolicy
from common.cli import log_to_stderr, run_main
from common.metrics import serve_metrics
from metropolis.errors import MetropolisError
from metropolis.localstorage import Root
from metropolis.owner import OwnerAccess, load_owner, load_owner_from_cluster, load_owner_key
from shepherd.agent_bundle import agent_zipapp
from shepherd.agent_start import AgentConfig
from shepherd.approver import DEFAULT_INTERVAL as APPROVE_INTERVAL
from shepherd.approver import run_approver
from shepherd.arguments import COMMANDS as COMMANDS
from shepherd.arguments import build_parser as build_parser
from shepherd.control_loop import LoopStats, start_control_loop
from shepherd.decommissioner import Decommissioner
from shepherd.errors import ShepherdError
from shepherd.initializer import Initializer
from shepherd.metrics import LoopCollector
from shepherd.providers import Provider, ProviderError
from shepherd.providers.equinix.client import EquinixClient
from shepherd.providers.equinix.provider import (
    EquinixConfig,
    EquinixConfigError,
    EquinixProvider,
)
from shepherd.providers.redfish import BMCConfigError, load_credentials
from shepherd.providers.static import StaticFileError, StaticProvider
from shepherd.provisioner import Provisioner, ProvisionerConfig
from shepherd.pruner import DEFAULT_INTERVAL as PRUNE_INTERVAL
from shepherd.pruner import Pruner, PrunerConfig
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.recoverer import Recoverer
from shepherd.ssh import SSHClient
from shepherd.ssh_key import SSHKey, SSHKeyError, load_or_create_ssh_key
from shepherd.updater import Updater, UpdaterConfig
from shepherd.upgrader import UPGRADE_WORKERS, Upgrader

logger = logging.getLogger("shepherd.cli")


@dataclass(frozen=True)
class Options:
    """Everything the initializer needs, validated."""

    bmdb_url: str
    provider: Provider
    ssh_key: SSHKey
    ssh_key_path: Path
    agent: AgentConfig
    rate: Rate
    parallelism: int
    verbose: bool
    provisioner: ProvisionerConfig = field(default_factory=ProvisionerConfig)
    #: None: the updater does not run.
    updater: UpdaterConfig | None = field(default_factory=UpdaterConfig)
    #: The Equinix API client to close at exit (``--provider equinix`` only).
    equinix_client: EquinixClient | None = None
    #: ``HOST:PORT`` to serve Prometheus metrics on, or None for none.
    metrics_listen: str | None = None
    #: Seconds between two fleet gauge queries.
    fleet_period: float = DEFAULT_FLEET_PERIOD
    recoverer: RecovererOptions = field(default_factory=lambda: RecovererOptions())
    #: None: the approver does not run.
    approver: ApproverOptions | None = None
    #: The cluster owner's credentials (the decommissioner removes nodes with
    #: them); None: none were given.
    owner: OwnerAccess | None = None
    #: None: the pruner does not run.
    pruner: PrunerConfig | None = None


@dataclass(frozen=True)
class ApproverOptions:
    """How the approver reaches the cluster, and how often it looks."""

    access: OwnerAccess
    interval: float = APPROVE_INTERVAL


@dataclass(frozen=True)
class RecovererOptions:
    """How the recoverer runs."""

    rate: Rate = field(default_factory=lambda: Rate.parse("250ms,8"))
    parallelism: int = 1
    first_heartbeat_timeout: float = AGENT_FIRST_HEARTBEAT_TIMEOUT
    heartbeat_timeout: float = AGENT_HEARTBEAT_TIMEOUT


def _pruner_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> PrunerConfig | None:
    """The pruner's policy, or None if none was given; exit with status 2
    if the retention options do not go together."""
    keep_last, keep_newer_than = args.retention_keep_last, args.retention_keep_newer_than
    if keep_last is None and keep_newer_than is None:
        if args.retention_interval is not None:
            parser.error(
                "--retention-interval needs --retention-keep-last and --retention-keep-newer-than"
            )
        return None
    if keep_last is None or keep_newer_than is None:
        parser.error("--retention-keep-last and --retention-keep-newer-than go together")
    return PrunerConfig(
        RetentionPolicy(keep_last=keep_last, keep_newer_than=keep_newer_than),
        interval=args.retention_interval or PRUNE_INTERVAL,
    )


def _owner_access(parser: argparse.ArgumentParser, args: argparse.Namespace) -> OwnerAccess | None:
    """The cluster owner's credentials, or None if none were given; exit with
    status 2 if they do not go together or are unusable (read now: a wrong
    path is a start-up error)."""
    where = [f for f in (args.cluster_owner_root, args.cluster_owner_info) if f is not None]
    if len(where) > 1:
        parser.error("--cluster-owner-root and --cluster-owner-info exclude each other")
    if args.cluster_owner_key is None:
        if where:
            parser.error("--cluster-owner-root or --cluster-owner-info needs --cluster-owner-key")
        return None
    if not where:
        parser.error("--cluster-owner-key needs --cluster-owner-root or --cluster-owner-info")
    try:
        key = load_owner_key(args.cluster_owner_key)
        if args.cluster_owner_root is not None:
            return load_owner(Root(args.cluster_owner_root.resolve()), key)
        return load_owner_from_cluster(args.cluster_owner_info.resolve(), key)
    except MetropolisError as exc:
        parser.error(f"the cluster owner's credentials: {exc}")


def _approver_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace, owner: OwnerAccess | None
) -> ApproverOptions | None:
    """The approver's options; exit with status 2 without the owner's credentials."""
    if not args.approve_installed:
        return None
    if owner is None:
        parser.error(
            "--approve-installed needs --cluster-owner-key with --cluster-owner-root "
            "or --cluster-owner-info"
        )
    return ApproverOptions(owner, args.approve_interval)


def parse_options(argv: Sequence[str] | None = None) -> Options:
    """Parse and validate the command line; exit with status 2 on any problem."""
    parser = build_parser()
    return validate_options(parser, parser.parse_args(argv))


def validate_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Options:
    """Check ``args`` (from ``parser``); exit with status 2 on any problem.

    The SSH key comes last: a missing key is generated, and a command line
    that fails any other check must leave nothing behind.
    """
    if args.provider == "static" and not args.static_machines_path:
        parser.error("the following arguments are required: --static-machines-path")
    equinix: EquinixConfig | None = None
    token = ""
    if args.provider == "equinix":
        equinix = EquinixConfig(
            args.equinix_project_id,
            args.equinix_ssh_key_label,
            args.equinix_device_prefix,
            args.provisioner_os,
        )
        try:
            equinix.check()
        except EquinixConfigError as exc:
            parser.error(str(exc))
        token = args.equinix_api_token or os.environ.get("METAL_AUTH_TOKEN", "")
        if not token:
            parser.error("--equinix-api-token or METAL_AUTH_TOKEN must be set")
    else:
        try:
            credentials = load_credentials(args.static_bmc_credentials_path)
        except BMCConfigError as exc:
            parser.error(f"argument --static-bmc-credentials-path: {exc}")
        try:
            static = StaticProvider.from_file(
                Path(args.static_machines_path),
                credentials=credentials,
                bmc_verify=args.static_bmc_ca_certificate_path or True,
            )
        except StaticFileError as exc:
            parser.error(f"argument --static-machines-path: {exc}")
    owner = _owner_access(parser, args)
    approver = _approver_options(parser, args, owner)
    pruner = _pruner_config(parser, args)
    executable = args.agent_executable_path or agent_zipapp()
    try:
        agent = AgentConfig(
            executable=executable,
            target_path=args.agent_target_path,
            endpoint=args.agent_endpoint,
            endpoint_ca_certificate=args.agent_endpoint_ca_certificate_path,
            ssh_connect_timeout=args.agent_ssh_connect_timeout,
            ssh_exec_timeout=args.agent_ssh_exec_timeout,
            heartbeat_interval=args.agent_heartbeat_interval,
            heartbeat_backoff_cap=args.agent_heartbeat_backoff_cap,
            systemd_unit=args.agent_systemd_unit,
        )
    except ValueError as exc:
        parser.error(str(exc))
    # Resolved once, so the file used is the one logged, whatever the
    # working directory later becomes.
    key_path = args.ssh_key_path.absolute()
    try:
        key = load_or_create_ssh_key(key_path)
    except SSHKeyError as exc:
        parser.error(f"argument --ssh-key-path: {exc}")
    client: EquinixClient | None = None
    provider: Provider
    if equinix is not None:
        client = EquinixClient(
            token, base_url=args.equinix_api_url, parallelism=args.equinix_api_parallelism
        )
        provider = EquinixProvider(client, equinix, key.authorized_key)
    else:
        provider = static
    return Options(
        bmdb_url=args.bmdb_url,
        provider=provider,
        ssh_key=key,
        ssh_key_path=key_path,
        agent=agent,
        rate=args.initializer_db_query_rate,
        parallelism=args.initializer_parallelism,
        verbose=args.verbose,
        provisioner=ProvisionerConfig(
            max_machines=args.provisioner_max_machines,
            chunk_size=args.provisioner_reservation_chunk_size,
            creation_rate=args.provisioner_device_creation_rate,
            reconciler_rate=args.provisioner_reconciler_rate,
            assimilate=args.provisioner_assimilate,
        ),
        updater=UpdaterConfig(
            iteration_interval=args.updater_iteration_rate,
            batch_size=args.updater_batch_size,
            settled_interval=args.updater_settled_interval,
        )
        if args.updater_enable
        else None,
        equinix_client=client,
        metrics_listen=args.metrics_listen,
        fleet_period=args.metrics_fleet_period,
        recoverer=RecovererOptions(
            rate=args.recoverer_db_query_rate,
            parallelism=args.recoverer_parallelism,
            first_heartbeat_timeout=args.recovery_first_heartbeat_timeout,
            heartbeat_timeout=args.recovery_heartbeat_timeout,
        ),
        approver=approver,
        owner=owner,
        pruner=pruner,
    )


async def _start_metrics(
    nursery: trio.Nursery, conn: bmdb.Connection, stats: LoopStats, options: Options
) -> None:
    """Serve the BMDB client's, the control loop's and the fleet's metrics."""
    assert options.metrics_listen is not None
    registry = CollectorRegistry()
    fleet = FleetGauges(conn, options.fleet_period)
    for collector in (ConnectionCollector(conn, "shepherd"), LoopCollector(stats), fleet):
        registry.register(collector)
    urls = await nursery.start(serve_metrics, registry, options.metrics_listen)
    logger.info("metrics at %s/metrics", urls[0])
    await nursery.start(fleet.run)


async def run(options: Options) -> None:
    """Run the loops (initializer and recoverer among them) until SIGINT/SIGTERM.

    Raises BMDBError if the BMDB is unusable, ProviderError if the provider
    refuses us at start (e.g. the Equinix SSH key cannot be ensured).
    """
    ssh = SSHClient(
        options.ssh_key, username="root", connect_timeout=options.agent.ssh_connect_timeout
    )
    provider = options.provider
    initializer = Initializer(provider, ssh, options.agent)
    recoverer = Recoverer(
        provider,
        first_heartbeat_timeout=options.recoverer.first_heartbeat_timeout,
        heartbeat_timeout=options.recoverer.heartbeat_timeout,
    )
    decommissioner = Decommissioner(
        provider, ssh, agent_target_path=options.agent.target_path, owner=options.owner
    )
    provisioner = Provisioner(provider, options.provisioner)
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with (
                bmdb.open_connection(options.bmdb_url) as conn,
                trio_asyncio.open_loop(),
                trio.open_nursery() as nursery,
            ):
                # Once the BMDB is there: a failure to reach it is the only line.
                logger.info(
                    "SSH key %s, public key: %s",
                    options.ssh_key_path,
                    options.ssh_key.authorized_key,
                )
                logger.info(
                    "agent to upload: %d bytes, sha256 %s",
                    len(options.agent.executable),
                    hashlib.sha256(options.agent.executable).hexdigest(),
                )
                stats = LoopStats()
                if options.metrics_listen:
                    await _start_metrics(nursery, conn, stats, options)
                if isinstance(provider, EquinixProvider):
                    await provider.ensure_ssh_key()
                nursery.start_soon(provisioner.run, conn)
                if options.updater is not None:
                    nursery.start_soon(Updater(provider, options.updater).run, conn)
                start_control_loop(
                    nursery,
                    conn,
                    initializer,
                    parallelism=options.parallelism,
                    limiter=RateLimiter(options.rate),
                    stats=stats,
                )
                start_control_loop(
                    nursery,
                    conn,
                    recoverer,
                    parallelism=options.recoverer.parallelism,
                    limiter=RateLimiter(options.recoverer.rate),
                )
                # Decommissions are rare and operator-driven: one worker,
                # at the recoverer's query rate.
                start_control_loop(
                    nursery,
                    conn,
                    decommissioner,
                    parallelism=1,
                    limiter=RateLimiter(options.recoverer.rate),
                )
                # Rolling upgrades: each worker holds one machine for its whole
                # upgrade, so the workers bound how many go at once too.
                start_control_loop(
                    nursery,
                    conn,
                    Upgrader(options.owner),
                    parallelism=UPGRADE_WORKERS,
                    limiter=RateLimiter(options.recoverer.rate),
                )
                if options.pruner is not None:
                    nursery.start_soon(Pruner(conn, options.pruner).run)
                if options.approver is not None:
                    nursery.start_soon(
                        run_approver, options.approver.access, conn, options.approver.interval
                    )
                async for signum in signals:
                    logger.info("got %s, stopping", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break
    finally:
        if options.equinix_client is not None:
            with trio.CancelScope(shield=True):
                await options.equinix_client.aclose()


def run_parsed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Validate ``args`` (parsed by ``parser``: `build_parser`) and run the
    loops until SIGINT/SIGTERM; the exit status (2 for a bad option)."""
    # Logging first: validation generates a missing SSH key, and says so.
    log_to_stderr(args.verbose)
    # asyncssh logs every connection at INFO; our own logs say what matters.
    logging.getLogger("asyncssh").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    # httpx logs every request at INFO; failures are logged by our clients.
    logging.getLogger("httpx").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    options = validate_options(parser, args)

    def body() -> int:
        trio.run(run, options)
        return 0

    # Errors arrive grouped (our nursery inside trio-asyncio's); run_main
    # prints each leaf: a BMDB or Shepherd error as one line (a provider's
    # named after it), a bug with its traceback.
    return run_main(
        "shepherd",
        body,
        known=(BMDBError, ShepherdError),
        labels=[(ProviderError, options.provider.type)],
    )
