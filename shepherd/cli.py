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
decommission waits, saying why), and ``--approve-installed`` (which needs
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
machines to install the node image (see `shepherd.install`).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import datetime
import hashlib
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import trio
import trio_asyncio
from cryptography import x509
from prometheus_client import CollectorRegistry

import bmdb
from bmdb.errors import BMDBError
from bmdb.metrics import DEFAULT_FLEET_PERIOD, ConnectionCollector, FleetGauges
from bmdb.model import AGENT_FIRST_HEARTBEAT_TIMEOUT, AGENT_HEARTBEAT_TIMEOUT
from bmdb.retention import RetentionPolicy, parse_age
from common.cli import run_main
from common.commands import DEFAULT, commands_description
from common.exitcodes import show_in_help
from common.listen import listen_address
from common.metrics import serve_metrics
from metropolis.errors import MetropolisError
from metropolis.localstorage import Root
from metropolis.owner import OwnerAccess, load_owner, load_owner_from_cluster, load_owner_key
from shepherd.agent_bundle import agent_zipapp
from shepherd.agent_start import AgentConfig
from shepherd.approver import DEFAULT_INTERVAL as APPROVE_INTERVAL
from shepherd.approver import run_approver
from shepherd.control_loop import LoopStats, start_control_loop
from shepherd.decommissioner import Decommissioner
from shepherd.errors import ShepherdError
from shepherd.initializer import Initializer
from shepherd.metrics import LoopCollector
from shepherd.providers import Provider, ProviderError
from shepherd.providers.equinix.client import DEFAULT_API_URL, EquinixClient
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
from shepherd.rate_limit import Rate, RateLimiter, parse_duration
from shepherd.recoverer import Recoverer
from shepherd.ssh import SSHClient
from shepherd.ssh_key import SSHKey, SSHKeyError, load_or_create_ssh_key
from shepherd.updater import Updater, UpdaterConfig

logger = logging.getLogger("shepherd.cli")

T = TypeVar("T")

_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n(.*?)-----END \1-----", re.DOTALL)


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


def _arg_type(name: str, parse: Callable[[str], T]) -> Callable[[str], T]:
    """Turn a parser raising ValueError/OSError into an argparse type with a clear message."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except (ValueError, OSError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    convert.__name__ = name  # argparse uses it in "invalid <name> value" messages
    return convert


#: Largest CA certificate file accepted; a certificate chain is kilobytes.
MAX_CERTIFICATE_FILE = 1 << 20


def _read_file(path: str, limit: int | None = None) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(-1 if limit is None else limit + 1)
    except OSError as exc:
        raise ValueError(f"could not read {path}: {exc.strerror}") from exc
    if limit is not None and len(data) > limit:
        raise ValueError(f"{path}: larger than {limit // (1 << 20)} MiB; refusing it")
    return data


def pem_certificate_der(path: str) -> bytes:
    """The DER bytes of the first PEM block of ``path``, which must be a certificate."""
    data = _read_file(path, MAX_CERTIFICATE_FILE)
    match = _PEM_BLOCK.search(data)
    if match is None:
        raise ValueError(f"{path}: no PEM block found")
    if match.group(1) != b"CERTIFICATE":
        raise ValueError(f"{path}: not a certificate (PEM block is {match.group(1).decode()!r})")
    try:
        der = base64.b64decode(match.group(2), validate=False)
        x509.load_der_x509_certificate(der)
    except (ValueError, binascii.Error) as exc:
        raise ValueError(f"{path}: invalid certificate: {exc}") from exc
    return der


def _positive_duration(text: str) -> float:
    seconds = parse_duration(text)
    if seconds <= 0:
        raise ValueError(f"duration must be positive, got {text!r}")
    return seconds


def _age(text: str) -> datetime.timedelta:
    try:
        return parse_age(text)
    except BMDBError as exc:
        raise ValueError(str(exc)) from exc


def _parallelism(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return value


def _ca_bundle(path: str) -> str:
    pem_certificate_der(path)  # readable, and a certificate
    return path


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must not be negative, got {value}")
    return value


def _nonempty_file(path: str) -> bytes:
    data = _read_file(path)
    if not data:
        raise ValueError(f"{path} is empty")
    return data


#: What ``python -m shepherd`` can do, as its ``--help`` starts (and the README lists).
COMMANDS = (
    (DEFAULT, "run the control loops: takeover, provisioning, recovery, decommission"),
    ("install", "ask machines to install the node image (its own --help)"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shepherd",
        usage="%(prog)s [install ...] --bmdb-url URL --provider {static,equinix} [options]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=commands_description(
            COMMANDS,
            "Without a command the Shepherd runs its control loops on the BMDB at --bmdb-url"
            " and the machines of --provider until SIGINT/SIGTERM: the options below are"
            " theirs. 'python -m shepherd install --help' gives install's own.",
        ),
        epilog="'python -m shepherd install --help': ask machines to install the node image.",
    )
    show_in_help(parser)
    db = parser.add_argument_group("BMDB")
    db.add_argument(
        "--bmdb-url", required=True, metavar="URL", help="libpq URL of the BMDB (already migrated)"
    )

    prov = parser.add_argument_group("provider")
    prov.add_argument(
        "--provider", required=True, choices=["static", "equinix"], help="machine provider"
    )
    prov.add_argument(
        "--static-machines-path",
        metavar="PATH",
        help="TOML file listing the machines (required with --provider static)",
    )
    prov.add_argument(
        "--static-bmc-credentials-path",
        type=Path,
        metavar="PATH",
        help="TOML file of Redfish BMC credentials ([default], [machine.ID]); "
        "else SHEPHERD_BMC_USERNAME / SHEPHERD_BMC_PASSWORD",
    )

    prov.add_argument(
        "--static-bmc-ca-certificate-path",
        type=_arg_type("certificate", _ca_bundle),
        default=None,
        metavar="PATH",
        help="PEM CA certificate(s) BMCs' HTTPS certificates are checked against "
        "(default: system CAs)",
    )

    eq = parser.add_argument_group("Equinix Metal (--provider equinix)")
    eq.add_argument(
        "--equinix-project-id", default="", metavar="UUID", help="project to manage devices in"
    )
    eq.add_argument(
        "--equinix-ssh-key-label",
        default="shepherd-FIXME",
        metavar="LABEL",
        help="label of the Shepherd's SSH key in the project (default: %(default)s, "
        "refused: set it)",
    )
    eq.add_argument(
        "--equinix-device-prefix",
        default="shepherd-FIXME-",
        metavar="PREFIX",
        help="hostname prefix of the devices the Shepherd manages (default: %(default)s, "
        "refused: set it)",
    )
    eq.add_argument(
        "--equinix-api-url",
        default=DEFAULT_API_URL,
        metavar="URL",
        help="API base URL (default: %(default)s)",
    )
    eq.add_argument(
        "--equinix-api-token",
        default=None,
        metavar="TOKEN",
        help="API token (default: $METAL_AUTH_TOKEN; prefer the environment)",
    )
    eq.add_argument(
        "--equinix-api-parallelism",
        type=_arg_type("count", _parallelism),
        default=4,
        metavar="N",
        help="API requests in flight at once (default: 4)",
    )

    provision = parser.add_argument_group("provisioner")
    provision.add_argument(
        "--provisioner-os",
        default="ubuntu_20_04",
        metavar="SLUG",
        help="OS deployed on new Equinix devices (default: %(default)s)",
    )
    provision.add_argument(
        "--provisioner-max-machines",
        type=_arg_type("count", _count),
        default=50,
        metavar="N",
        help="stop creating machines at this many; 0 for no limit (default: 50)",
    )
    provision.add_argument(
        "--provisioner-reservation-chunk-size",
        type=_arg_type("count", _parallelism),
        default=20,
        metavar="N",
        help="machines created per reconciliation at most (default: 20)",
    )
    provision.add_argument(
        "--provisioner-device-creation-rate",
        type=_arg_type("rate", Rate.parse),
        default=Rate.parse("5s,1"),
        metavar="DURATION,BURST",
        help="rate limit of device creation (default: 5s,1)",
    )
    provision.add_argument(
        "--provisioner-reconciler-rate",
        type=_arg_type("rate", Rate.parse),
        default=Rate.parse("1m,1"),
        metavar="DURATION,BURST",
        help="rate limit of reconciliations (default: 1m,1)",
    )
    provision.add_argument(
        "--provisioner-assimilate",
        action="store_true",
        help="add devices under the prefix that the BMDB lacks, instead of reporting them",
    )

    update = parser.add_argument_group("updater")
    update.add_argument(
        "--updater-enable",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="refresh provided machines' address, location and status (default: on)",
    )
    update.add_argument(
        "--updater-iteration-rate",
        type=_arg_type("duration", _positive_duration),
        default=60.0,
        metavar="DURATION",
        help="at most one updater pass per DURATION (default: 1m)",
    )
    update.add_argument(
        "--updater-settled-interval",
        type=_arg_type("duration", _positive_duration),
        default=1800.0,
        metavar="DURATION",
        help="how often a Running machine whose state did not change is asked again (default: 30m)",
    )
    update.add_argument(
        "--updater-batch-size",
        type=_arg_type("count", _parallelism),
        default=50,
        metavar="N",
        help="machines refreshed at once and written in one transaction (default: 50)",
    )

    ssh = parser.add_argument_group("SSH")
    ssh.add_argument(
        "--ssh-key-path",
        required=True,
        type=Path,
        metavar="PATH",
        help="the Shepherd's Ed25519 SSH key; generated there (0600) if missing",
    )

    agent = parser.add_argument_group("agent")
    agent.add_argument(
        "--agent-executable-path",
        type=_arg_type("file", _nonempty_file),
        default=None,
        metavar="PATH",
        help="agent to upload (default: the bundled agent, a zipapp)",
    )
    agent.add_argument(
        "--agent-target-path",
        default="/root/agent",
        metavar="PATH",
        help="where the agent is uploaded to and run from (default: %(default)s)",
    )
    agent.add_argument(
        "--agent-endpoint",
        required=True,
        metavar="ADDRESS",
        help="the agent callback server the agents heartbeat to: https://HOST:PORT or "
        "HOST:PORT (HTTPS), or http://HOST:PORT (plain, e.g. behind a TLS proxy)",
    )
    agent.add_argument(
        "--agent-endpoint-ca-certificate-path",
        type=_arg_type("certificate", pem_certificate_der),
        default=b"",
        metavar="PATH",
        help="PEM X.509 CA certificate of the endpoint (default: system CAs)",
    )
    agent.add_argument(
        "--agent-ssh-connect-timeout",
        type=_arg_type("duration", _positive_duration),
        default=2.0,
        metavar="DURATION",
        help="bound on TCP connect + SSH handshake, e.g. 2s (default: 2s)",
    )
    agent.add_argument(
        "--agent-ssh-exec-timeout",
        type=_arg_type("duration", _positive_duration),
        default=60.0,
        metavar="DURATION",
        help="bound on dial + upload + run, e.g. 60s (default: 60s)",
    )

    agent.add_argument(
        "--agent-heartbeat-interval",
        type=_arg_type("duration", _positive_duration),
        default=10.0,
        metavar="DURATION",
        help="how often agents heartbeat to the endpoint (default: 10s)",
    )
    agent.add_argument(
        "--agent-heartbeat-backoff-cap",
        type=_arg_type("duration", _positive_duration),
        default=60.0,
        metavar="DURATION",
        help="longest pause of an agent whose heartbeats fail (default: 1m)",
    )
    agent.add_argument(
        "--agent-systemd-unit",
        action="store_true",
        help="run each heartbeating agent as a unit of its machine's systemd "
        "(metropolis-agent.service), so that it comes back after a reboot and reports the "
        "installed generation; a machine without systemd gets the detached agent and a warning",
    )

    init = parser.add_argument_group("initializer")
    init.add_argument(
        "--initializer-db-query-rate",
        type=_arg_type("rate", Rate.parse),
        default=Rate.parse("250ms,8"),
        metavar="DURATION,BURST",
        help="rate limit of BMDB queries: one token per DURATION, bucket of BURST "
        "(default: 250ms,8)",
    )
    init.add_argument(
        "--initializer-parallelism",
        type=_arg_type("count", _parallelism),
        default=1,
        metavar="N",
        help="machines worked on at once (default: 1)",
    )
    metrics = parser.add_argument_group("metrics")
    metrics.add_argument(
        "--metrics-listen",
        type=_arg_type("address", listen_address),
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)",
    )
    metrics.add_argument(
        "--metrics-fleet-period",
        type=_arg_type("duration", _positive_duration),
        default=DEFAULT_FLEET_PERIOD,
        metavar="DURATION",
        help="how often the fleet gauges are queried (default: 15s)",
    )

    rec = parser.add_argument_group("recoverer")
    rec.add_argument(
        "--recoverer-db-query-rate",
        type=_arg_type("rate", Rate.parse),
        default=Rate.parse("250ms,8"),
        metavar="DURATION,BURST",
        help="rate limit of the recoverer's BMDB queries (default: 250ms,8)",
    )
    rec.add_argument(
        "--recoverer-parallelism",
        type=_arg_type("count", _parallelism),
        default=1,
        metavar="N",
        help="machines recovered at once (default: 1)",
    )
    rec.add_argument(
        "--recovery-first-heartbeat-timeout",
        type=_arg_type("duration", _positive_duration),
        default=AGENT_FIRST_HEARTBEAT_TIMEOUT,
        metavar="DURATION",
        help="recover a started agent that never heartbeated for this long (default: 30m)",
    )
    rec.add_argument(
        "--recovery-heartbeat-timeout",
        type=_arg_type("duration", _positive_duration),
        default=AGENT_HEARTBEAT_TIMEOUT,
        metavar="DURATION",
        help="recover an agent whose last heartbeat is older than this (default: 10m)",
    )
    _add_approver_arguments(parser)
    _add_retention_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def _add_approver_arguments(parser: argparse.ArgumentParser) -> None:
    approve = parser.add_argument_group(
        "cluster owner (the approver, --approve-installed; the decommissioner removes nodes)"
    )
    approve.add_argument(
        "--approve-installed",
        action="store_true",
        help="approve the cluster's NEW nodes that a machine's agent reported installing",
    )
    approve.add_argument(
        "--cluster-owner-root",
        type=Path,
        metavar="DIR",
        help="a cluster node's root with the owner certificate ('metropolis owner --root')",
    )
    approve.add_argument(
        "--cluster-owner-info",
        type=Path,
        metavar="FILE",
        help="instead of a root: the cluster file 'metropolis owner info --out' writes",
    )
    approve.add_argument(
        "--cluster-owner-key",
        type=Path,
        metavar="FILE",
        help="the cluster owner's private key ('metropolis owner --owner-key')",
    )
    approve.add_argument(
        "--approve-interval",
        type=_arg_type("duration", _positive_duration),
        default=APPROVE_INTERVAL,
        metavar="DURATION",
        help=f"time between two approver rounds (default: {APPROVE_INTERVAL:g}s)",
    )


def _add_retention_arguments(parser: argparse.ArgumentParser) -> None:
    retain = parser.add_argument_group(
        "retention (the pruner: off unless both --retention-keep-* options are given)"
    )
    retain.add_argument(
        "--retention-keep-last",
        type=_arg_type("count", _count),
        metavar="N",
        help="keep each machine's newest N work history and audit records, whatever their age",
    )
    retain.add_argument(
        "--retention-keep-newer-than",
        type=_arg_type("age", _age),
        metavar="AGE",
        help="keep every record newer than AGE: a number and s, m, h or d (e.g. 90d)",
    )
    retain.add_argument(
        "--retention-interval",
        type=_arg_type("duration", _positive_duration),
        metavar="DURATION",
        help=f"time between two prunes (default: {PRUNE_INTERVAL:g}s)",
    )


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


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["install"]:
        return _install(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    # Logging first: validation generates a missing SSH key, and says so.
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
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


def _install(argv: Sequence[str]) -> int:
    """``python -m shepherd install``: its own command line (`shepherd.install`),
    imported only when asked for."""
    from shepherd.install import main as install_main

    return install_main(argv)
