"""``python -m shepherd install``: ask machines' agents to install the node image.

For each chosen machine the command writes a new OSInstallationRequest (a
MetropolisInstallationRequest: the image, the root device, NodeParameters
that register the node into the cluster, and the machine's own address)
into the BMDB, with the generation after the machine's last one (1 for
its first). The agent callback server hands it to the agent in its next
heartbeat answer; the agent installs and reports on that generation, which
the BMDB views then show (``python -m bmdb machines``)::

    python -m shepherd install --bmdb-url URL \\
        --machine ID [--machine ID ...] | --state STATE --count N
        --cluster-info FILE --ticket HEX --owner-public-key FILE
        --image-url https://HOST:PORT/images/sha256/HEX
          | --image-server https://HOST:PORT --image-digest sha256:HEX
        [--image-server-ca FILE] [--insecure-plain-http]
        --root-device NAME [--reinstall] [--dry-run]

What is checked, and where:

- Before anything is read from the BMDB: the options (a cluster info file
  that is not one ``metropolis owner info --out`` writes, a ticket that is
  not hex, an owner key that is none, a root device name that could be a
  path: usage errors, exit status 2), then the image: a HEAD request on
  its URL must answer 200 (TLS checked against ``--image-server-ca`` or
  the system's CAs). An image the server does not have, or a server that
  cannot be reached, refuses the whole run with one line (exit status 1).
- Then, in ONE transaction for the whole run, each machine (choosing them
  by ``--state`` in the same snapshot) is refused, with one line naming
  the machine and the cause, and nothing written for it, if: it does not
  exist; an operator holds it (``python -m bmdb hold``) or asked to
  decommission it; it has no hardware report yet; its report does not
  list the root device; it has no provider address (the node's ``--address``); its
  current generation is installed (a success report on the latest
  request) or still installing (no report on it yet), unless
  ``--reinstall``. A machine whose latest generation failed, or whose agent
  has since found it gone from the disk (install-lost), is installed again
  without ``--reinstall``: a new generation is a new attempt. The
  others get their request. One transaction, so that a count of machines
  by state means that many from one view of the fleet, and so that the run
  is written whole or not at all (a database error leaves nothing half
  done); SERIALIZABLE, so that two runs at once cannot give one machine the
  same generation twice (the loser is retried and computes the next one).

The image's digest names it (``sha256:`` and 64 lowercase hex digits, the
file's SHA-256), and the URL is ``{scheme}://{host}/images/sha256/{hex}``,
what the agent downloads and verifies before writing anything. Plain
``http`` is accepted only with ``--insecure-plain-http``: the agent's
digest check still refuses any other bytes, but anyone on the path sees
the image and can stall its download.

Root devices are named as the hardware report names them: by a block
device's ``serial_number`` (the reference's report has no other name; a
loopback disk, a folder standing for a disk, carries its folder name
there).
"""

from __future__ import annotations

import argparse
import logging
import re
import ssl
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

import bmdb
from bmdb import overview
from bmdb.errors import BMDBError
from bmdb.model import InstallationTarget, InstallState, Queries
from common.cli import run_trio_command
from common.protobuf import parse_checked
from common.text import printable
from metropolis.errors import MetropolisError
from metropolis.proto import parameters
from metropolis.proto.configuration import OsImageRef
from shepherd.errors import ShepherdError

# The command line's own module (--help imports nothing of the run); its
# words are this module's too.
from shepherd.install_options import build_parser as build_parser
from shepherd.install_options import owner_public_key as owner_public_key
from shepherd.install_options import valid_device_name as valid_device_name
from shepherd.proto.agent_callback import (
    AgentHardwareReport,
    MetropolisInstallationRequest,
    OsInstallationRequest,
)

logger = logging.getLogger("shepherd.install")

#: OSImageRef.repository of the node image.
REPOSITORY = "metropolis-node"

#: Seconds the image check may take (connect, TLS, answer).
IMAGE_CHECK_TIMEOUT = 15.0

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HOST = re.compile(r"[A-Za-z0-9.\-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")


class InstallError(ShepherdError):
    """A run of ``shepherd install`` refused as a whole (the image, the
    options): nothing was written."""


@dataclass(frozen=True)
class ImageRef:
    """Where the node image is and what it is."""

    scheme: str
    #: ``HOST`` or ``HOST:PORT`` of the image server.
    host: str
    #: The 64 lowercase hex digits of the image's SHA-256.
    sha256: str

    @property
    def digest(self) -> str:
        return f"sha256:{self.sha256}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}/images/sha256/{self.sha256}"

    def message(self) -> OsImageRef:
        """The OSImageRef the agent reads."""
        return OsImageRef(
            scheme=self.scheme, host=self.host, repository=REPOSITORY, tag="", digest=self.digest
        )


def _scheme_host(url: str, *, plain_http: bool, what: str) -> tuple[str, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http"):
        raise ValueError(f"{what}: want https://HOST:PORT..., got {url!r}")
    if parts.scheme == "http" and not plain_http:
        raise ValueError(f"{what}: plain http needs --insecure-plain-http")
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise ValueError(f"{what}: no user, query or fragment allowed in {url!r}")
    if not _HOST.fullmatch(parts.netloc):
        raise ValueError(f"{what}: not HOST or HOST:PORT: {parts.netloc!r}")
    return parts.scheme, parts.netloc


def image_from_url(url: str, *, plain_http: bool = False) -> ImageRef:
    """``{scheme}://{host}/images/sha256/{hex}`` as an `ImageRef`; ValueError otherwise."""
    scheme, host = _scheme_host(url, plain_http=plain_http, what="--image-url")
    path = urlsplit(url).path
    prefix = "/images/sha256/"
    sha = path.removeprefix(prefix)
    if not path.startswith(prefix) or not _HEX64.fullmatch(sha):
        raise ValueError(
            f"--image-url: want a path /images/sha256/<64 lowercase hex>, got {path!r}"
        )
    return ImageRef(scheme, host, sha)


def image_from_server(server: str, digest: str, *, plain_http: bool = False) -> ImageRef:
    """An image server's base URL and a ``sha256:HEX`` digest as an `ImageRef`."""
    scheme, host = _scheme_host(server, plain_http=plain_http, what="--image-server")
    if urlsplit(server).path not in ("", "/"):
        raise ValueError(f"--image-server: want https://HOST:PORT without a path, got {server!r}")
    sha = digest.removeprefix("sha256:")
    if not digest.startswith("sha256:") or not _HEX64.fullmatch(sha):
        raise ValueError(f"--image-digest: want sha256:<64 lowercase hex>, got {digest[:100]!r}")
    return ImageRef(scheme, host, sha)


def image_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ImageRef:
    """The image ``--image-url``, or ``--image-server`` with ``--image-digest``,
    names (and ``--insecure-plain-http`` allows); a usage error otherwise."""
    try:
        if args.image_url is not None:
            if args.image_server is not None or args.image_digest is not None:
                parser.error("--image-url, or --image-server with --image-digest, not both")
            return image_from_url(args.image_url, plain_http=args.insecure_plain_http)
        if args.image_server is not None and args.image_digest is not None:
            return image_from_server(
                args.image_server, args.image_digest, plain_http=args.insecure_plain_http
            )
    except ValueError as e:
        parser.error(str(e))
    parser.error("the image: --image-url URL, or --image-server URL --image-digest D")


def root_devices(report: bytes) -> list[str]:
    """The root device names a stored (serialized AgentHardwareReport)
    hardware report lists: its block devices' serial numbers. ValueError
    if the bytes are no such report."""
    parsed = parse_checked(AgentHardwareReport, report)
    if parsed.report is None:
        return []
    return [d.serial_number for d in parsed.report.block_device if d.serial_number]


@dataclass(frozen=True)
class Plan:
    """What every chosen machine is asked to install."""

    #: Serialized, checked NodeParameters (register into the cluster).
    node_parameters: bytes
    image: ImageRef
    root_device: str
    reinstall: bool = False


@dataclass(frozen=True)
class Decision:
    """What the run does (or did) with one machine."""

    machine_id: uuid.UUID
    root_device: str
    #: The generation requested; None if refused.
    generation: int | None = None
    node_address: str | None = None
    #: Why nothing was written for the machine; None if requested.
    refused: str | None = None

    def line(self, *, dry_run: bool) -> str:
        if self.refused is not None:
            return f"refused {self.machine_id}: {self.refused}"
        verb = "would request" if dry_run else "requested"
        return (
            f"{verb} {self.machine_id} generation {self.generation} "
            f"root device {self.root_device} node address {self.node_address}"
        )


def decide(machine_id: uuid.UUID, target: InstallationTarget | None, plan: Plan) -> Decision:
    """Whether ``plan`` may be requested of the machine, and at which generation."""

    def refuse(why: str) -> Decision:
        return Decision(machine_id, plan.root_device, refused=why)

    if target is None:
        return refuse("no such machine")
    if target.held is not None:
        return refuse(f"held by {target.held} (python -m bmdb release ends the hold)")
    if target.decommissioned:
        return refuse("it is being decommissioned, or was")
    if target.hardware_report is None:
        return refuse("no hardware report yet (its agent has not sent one)")
    try:
        devices = root_devices(target.hardware_report)
    except ValueError as e:
        return refuse(f"its stored hardware report does not decode: {e}")
    if plan.root_device not in devices:
        listed = ", ".join(devices) if devices else "none"
        return refuse(
            f"root device {plan.root_device!r} is not in its hardware report (it lists: {listed})"
        )
    if not target.address:
        return refuse("no provider address, which the node would be started with")
    current = target.installation
    if current is not None and not plan.reinstall:
        if current.state is InstallState.INSTALLED:
            node = f" as {current.node_id}" if current.node_id else ""
            return refuse(
                f"already installed at generation {current.generation}{node} "
                "(--reinstall installs again)"
            )
        if current.state is InstallState.INSTALLING:
            return refuse(
                f"generation {current.generation} is still installing, not reported yet "
                "(--reinstall replaces it)"
            )
    generation = 1 if current is None else current.generation + 1
    return Decision(machine_id, plan.root_device, generation, target.address)


def request_bytes(plan: Plan, generation: int, node_address: str) -> bytes:
    """The serialized OSInstallationRequest of ``generation``."""
    return bytes(
        OsInstallationRequest(
            generation=generation,
            metropolis=MetropolisInstallationRequest(
                node_parameters=plan.node_parameters,
                root_device=plan.root_device,
                os_image=bytes(plan.image.message()),
                node_address=node_address,
            ),
        )
    )


async def check_image(image: ImageRef, context: ssl.SSLContext) -> None:
    """`InstallError` unless a HEAD request on the image's URL answers 200."""
    try:
        async with httpx.AsyncClient(verify=context, timeout=IMAGE_CHECK_TIMEOUT) as client:
            response = await client.head(image.url)
    except httpx.HTTPError as e:
        raise InstallError(f"image server unreachable at {image.url}: {_why(e)}") from e
    if response.status_code == 404:
        raise InstallError(f"image server does not have {image.digest} (404 from {image.url})")
    if response.status_code != 200:
        raise InstallError(f"image server answered {response.status_code} for {image.url}, not 200")


def _why(error: BaseException) -> str:
    """The first non-empty message along ``error``'s causes (httpx's
    connection errors often have none of their own: the TLS or socket
    error beneath says what happened), else its type's name."""
    seen: BaseException | None = error
    while seen is not None:
        if str(seen):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return type(error).__name__


async def install(
    conn: bmdb.Connection,
    plan: Plan,
    *,
    machines: Sequence[uuid.UUID] = (),
    state: str | None = None,
    count: int | None = None,
    dry_run: bool = False,
) -> list[Decision]:
    """Decide for each machine (``machines``, or up to ``count`` in
    ``state``, oldest first) and write the requests of those not refused,
    in one transaction; with ``dry_run``, decide and write nothing.
    Raises what `Connection.transact` raises (nothing is then written)."""

    async def body(q: Queries) -> list[Decision]:
        if machines:
            ids = list(dict.fromkeys(machines))
        else:
            assert state is not None and count is not None
            ids = await overview.machine_ids(q, limit=count, state=state)
        decisions = []
        for machine_id in ids:
            decision = decide(machine_id, await q.installation_target(machine_id), plan)
            if decision.refused is None and not dry_run:
                assert decision.generation is not None and decision.node_address is not None
                written = await q.set_os_installation_request(
                    machine_id,
                    decision.generation,
                    request_bytes(plan, decision.generation, decision.node_address),
                    root_device=plan.root_device,
                    image_digest=plan.image.digest,
                    node_address=decision.node_address,
                )
                if not written:  # cannot happen under SERIALIZABLE; refuse rather than guess
                    decision = Decision(
                        machine_id, plan.root_device, refused="a newer request appeared meanwhile"
                    )
            decisions.append(decision)
        return decisions

    isolation = bmdb.Isolation.REPEATABLE_READ if dry_run else bmdb.Isolation.SERIALIZABLE
    return await conn.transact(body, isolation=isolation)


def summary(decisions: Sequence[Decision], *, dry_run: bool) -> str:
    requested = sum(d.refused is None for d in decisions)
    verb = "would be requested" if dry_run else "requested"
    return (
        f"{len(decisions)} machine(s): {requested} {verb}, {len(decisions) - requested} refused"
        + (" (dry run: nothing written)" if dry_run else "")
    )


@dataclass(frozen=True)
class Options:
    """A checked command line."""

    bmdb_url: str
    plan: Plan
    machines: tuple[uuid.UUID, ...]
    state: str | None
    count: int | None
    ssl_context: ssl.SSLContext
    dry_run: bool
    verbose: bool = False


def parse_options(argv: Sequence[str] | None = None) -> Options:
    """Parse and check the command line; exit with status 2 on any problem."""
    parser = build_parser()
    return check_options(parser, parser.parse_args(argv))


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Options:
    """Check ``args`` (parsed by ``parser``: `build_parser`) together, read the
    cluster info, load the image server's CA; exit with status 2 on any problem."""
    if bool(args.machine) == (args.state is not None):
        parser.error("choose machines with --machine ID, or with --state STATE --count N")
    if (args.state is None) != (args.count is None):
        parser.error("--state and --count go together")
    image = image_from_args(parser, args)
    try:
        info = parameters.read_cluster_info(args.cluster_info)
        params = parameters.register_parameters(info, args.ticket, args.owner_public_key)
    except parameters.NodeParametersError as e:
        parser.error(f"argument --cluster-info: {e}")
    try:
        context = ssl.create_default_context(
            cafile=None if args.image_server_ca is None else str(args.image_server_ca)
        )
    except (OSError, ssl.SSLError) as e:
        parser.error(f"argument --image-server-ca: {args.image_server_ca}: {e}")
    return Options(
        bmdb_url=args.bmdb_url,
        plan=Plan(
            node_parameters=parameters.encode(params),
            image=image,
            root_device=args.root_device,
            reinstall=args.reinstall,
        ),
        machines=tuple(args.machine),
        state=args.state,
        count=args.count,
        ssl_context=context,
        dry_run=args.dry_run,
        verbose=args.verbose,
    )


async def run(options: Options) -> int:
    """Check the image, decide and write; print a line per machine and a
    summary. Returns the exit status (1 if any machine was refused)."""
    await check_image(options.plan.image, options.ssl_context)
    async with bmdb.open_connection(options.bmdb_url, max_connections=1) as conn:
        decisions = await install(
            conn,
            options.plan,
            machines=options.machines,
            state=options.state,
            count=options.count,
            dry_run=options.dry_run,
        )
    if not decisions:
        raise InstallError(f"no machines in state {options.state}")
    for d in decisions:
        # Causes quote the agent's hardware report: escaped, so that none
        # can drive the terminal or forge a line.
        print(printable(d.line(dry_run=options.dry_run)))
    print(summary(decisions, dry_run=options.dry_run))
    return 0 if all(d.refused is None for d in decisions) else 1


def run_parsed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Check ``args`` (parsed by ``parser``: `build_parser`) and run; the exit status."""
    options = check_options(parser, args)
    known = (BMDBError, ShepherdError, MetropolisError)
    return run_trio_command("shepherd install", run, options, verbose=options.verbose, known=known)
