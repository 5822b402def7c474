"""The Shepherd's command line: its parser, and the checks of single values.

Apart from :mod:`shepherd.cli` (which validates the options together and
runs the loops) so that ``python -m shepherd --help`` and a usage error
import none of the loops' modules (asyncssh, the providers, the BMDB's
driver, the metrics server; ``tests/test_cli_imports.py``). The defaults
the loops' modules define are written down here (`DEFAULTS`;
``tests/shepherd/test_cli.py`` holds them equal to the modules' own).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import datetime
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from bmdb.errors import BMDBError
from bmdb.retention import parse_age
from common.commands import DEFAULT, commands_description
from common.exitcodes import show_in_help
from common.listen import listen_address
from shepherd.rate import Rate, parse_duration

__all__ = ["COMMANDS", "DEFAULTS", "MAX_CERTIFICATE_FILE", "build_parser", "pem_certificate_der"]

T = TypeVar("T")

_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n(.*?)-----END \1-----", re.DOTALL)

#: The defaults of the loops' own modules, as this parser gives them:
#: (the option's destination, its default). Equal to the modules' constants.
DEFAULTS: dict[str, object] = {
    # shepherd.providers.equinix.client.DEFAULT_API_URL
    "equinix_api_url": "https://api.equinix.com/metal/v1",
    # bmdb.metrics.DEFAULT_FLEET_PERIOD
    "metrics_fleet_period": 15.0,
    # bmdb.model.AGENT_FIRST_HEARTBEAT_TIMEOUT and AGENT_HEARTBEAT_TIMEOUT
    "recovery_first_heartbeat_timeout": 30 * 60.0,
    "recovery_heartbeat_timeout": 10 * 60.0,
    # shepherd.approver.DEFAULT_INTERVAL
    "approve_interval": 5.0,
}

#: The pruner's interval when --retention-interval is not given
#: (shepherd.pruner.DEFAULT_INTERVAL).
PRUNE_INTERVAL = 3600.0


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
    # Imported here, when the option is given: --help needs no cryptography.
    from cryptography import x509

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
    (DEFAULT, "run the control loops: takeover, provisioning, recovery, decommission, upgrade"),
    ("install", "ask machines to install the node image (its own --help)"),
    ("upgrade", "move installed machines to a new image, A/B, quorum kept (its own --help)"),
)


def build_parser() -> argparse.ArgumentParser:
    """``python -m shepherd``'s parser (the control loops' options; ``install``
    and ``upgrade`` have their own). Parsing checks each value alone;
    `shepherd.cli.validate_options` checks them together and reads the files
    they name."""
    parser = argparse.ArgumentParser(
        prog="shepherd",
        usage="%(prog)s [install|upgrade ...] --bmdb-url URL --provider {static,equinix} [options]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=commands_description(
            COMMANDS,
            "Without a command the Shepherd runs its control loops on the BMDB at --bmdb-url"
            " and the machines of --provider until SIGINT/SIGTERM: the options below are"
            " theirs. 'python -m shepherd install --help' gives install's own, 'python -m"
            " shepherd upgrade --help' upgrade's.",
        ),
        epilog="'python -m shepherd install --help': ask machines to install the node image;"
        " 'python -m shepherd upgrade --help': move them to a new one.",
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
        default=DEFAULTS["equinix_api_url"],
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
        default=DEFAULTS["metrics_fleet_period"],
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
        default=DEFAULTS["recovery_first_heartbeat_timeout"],
        metavar="DURATION",
        help="recover a started agent that never heartbeated for this long (default: 30m)",
    )
    rec.add_argument(
        "--recovery-heartbeat-timeout",
        type=_arg_type("duration", _positive_duration),
        default=DEFAULTS["recovery_heartbeat_timeout"],
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
        default=DEFAULTS["approve_interval"],
        metavar="DURATION",
        help=f"time between two approver rounds (default: {DEFAULTS['approve_interval']:g}s)",
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
