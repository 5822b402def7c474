"""The takeover agent's program: what the Shepherd initializer uploads and runs.

It runs on a freshly provided machine that may have nothing but ``python3``,
so the whole agent (this package) is standard library only, imports nothing
else of the ``shepherd`` package, and is uploaded as one zipapp
(`shepherd.agent_bundle`) whose entry calls `main`.

Protocol (one exchange, then exit)::

    initializer --stdin-->  TakeoverInit {machine_id, bmaas_endpoint, ca_certificate}
                            |
                            v  validate (empty endpoint is refused)
                            v  load or create the Ed25519 key beside the agent
    initializer <-stdout--  TakeoverResponse {success {init_message, key, warning*}}
                         or TakeoverResponse {error {message}}

The exit status is 0 whenever a ``TakeoverResponse`` was written, error or not:
the response is the result, and the initializer reads it whatever the status.

With ``--heartbeat-interval SECONDS`` (the initializer always passes it) a
successful takeover does not end the agent: after writing the response it
detaches (`daemon`: double fork, new session, stdio to ``<agent>.log``), so
the SSH session ends, and heartbeats to ``bmaas_endpoint`` until killed
(`heartbeat`). Without it the agent only answers. ``--install-download-deadline``,
``--install-backoff-start`` and ``--install-backoff-cap`` (seconds) bound
the image downloads of its installs (`install.Settings`; the defaults
otherwise).

The heartbeating agent also installs the node when a heartbeat's answer
asks for it (`install`), onto a loopback disk beside it (`disks`) or a
real block device (`blockdev`), and upgrades it to another image, A/B,
when an answer asks for that (`upgrade`, `abslots`).

``--wipe`` (the decommissioner's, nothing on stdin) stops the agent and
the installed nodes, empties the loopback disks, removes the agent's key
and prints what it did as one JSON line (`wipe`).

Files beside the uploaded agent (``sys.argv[0]``): ``<agent>.key`` (its
private seed, `keyfile`), ``<agent>.pid``, ``<agent>.log`` and
``<agent>.install.json`` (the last installation generation begun, and its
outcome), ``<agent>.upgrade.json`` (the same for upgrades).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

# Only what the takeover exchange needs: the heartbeat's modules (daemon,
# heartbeat, hwreport, protocol) are imported where the heartbeat starts,
# since the uploaded agent's modules are compiled from source at each start.
from .ed25519 import ed25519_public_key
from .errors import AgentError
from .keyfile import load_or_create_seed
from .wire import DecodeError, TakeoverInit, encode_error, encode_success, iter_fields

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .heartbeat import Heartbeater
    from .install import Settings


def _beside(suffix: str) -> str:
    """A file beside the agent: ``<agent path><suffix>``."""
    return os.path.abspath(sys.argv[0]) + suffix


def take_over(init_bytes: bytes, key_file: str, more_warnings: Sequence[str] = ()) -> bytes:
    """Run one takeover exchange and return the encoded TakeoverResponse."""
    try:
        init = TakeoverInit.decode(init_bytes)
    except DecodeError as exc:
        return encode_error(f"malformed TakeoverInit on stdin: {exc}")
    if not init.bmaas_endpoint:
        return encode_error("TakeoverInit has an empty bmaas_endpoint")
    warnings: list[str] = list(more_warnings)
    try:
        seed = load_or_create_seed(key_file, warnings)
    except AgentError as exc:
        return encode_error(str(exc))
    return encode_success(init_bytes, ed25519_public_key(seed), warnings)


#: ``--install-*`` flag -> the `install.Settings` field it sets (seconds).
INSTALL_FLAGS = {
    "--install-download-deadline": "download_deadline",
    "--install-backoff-start": "backoff_start",
    "--install-backoff-cap": "backoff_cap",
}

USAGE = (
    "usage: agent [--heartbeat-interval S] [--heartbeat-backoff-cap S] "
    "[--install-download-deadline S] [--install-backoff-start S] [--install-backoff-cap S] "
    "[--install-layout BOOT,SYSTEM,DATA] [--install-after start|reboot|none] "
    "[--systemd-unit] [--init-file PATH]"
)


class Options:
    """The command line (`parse_args`)."""

    def __init__(self) -> None:
        self.interval: float | None = None
        self.cap = 60.0
        #: `install.Settings` fields given, in seconds (`INSTALL_FLAGS`).
        self.install: dict[str, float] = {}
        #: ``--install-layout``: a real disk's partition sizes in MiB.
        self.layout: tuple[int, int, int] | None = None
        self.after_install: str | None = None
        #: Run as a unit of the machine's systemd (`unit`).
        self.systemd_unit = False
        #: The unit's own start: TakeoverInit from this file, not stdin.
        self.init_file: str | None = None
        #: The flags a unit passes on (all but ``--systemd-unit``, ``--init-file``).
        self.unit_flags: list[str] = []


def parse_args(argv: list[str]) -> Options:
    """The options of ``argv``; AgentError (`USAGE`) or ValueError if bad."""
    options = Options()
    args = list(argv)
    while args:
        flag = args.pop(0)
        if flag == "--systemd-unit":
            options.systemd_unit = True
            continue
        seconds = (
            flag in ("--heartbeat-interval", "--heartbeat-backoff-cap") or flag in INSTALL_FLAGS
        )
        known = seconds or flag in ("--install-layout", "--install-after", "--init-file")
        if not known or not args:
            raise AgentError(f"{USAGE}, got {flag!r}")
        text = args.pop(0)
        if flag == "--init-file":
            options.init_file = text
            continue
        options.unit_flags += [flag, text]
        if flag == "--install-after":
            if text not in ("start", "reboot", "none"):
                raise AgentError(f"--install-after must be start, reboot or none, got {text!r}")
            options.after_install = text
            continue
        if flag == "--install-layout":
            sizes = tuple(int(x) for x in text.split(","))
            if len(sizes) != 3 or min(sizes) < 1:
                raise AgentError(f"--install-layout wants three positive MiB sizes, got {text!r}")
            options.layout = (sizes[0], sizes[1], sizes[2])
            continue
        value = float(text)
        if not 0 < value < float("inf"):
            raise AgentError(f"{flag} must be positive")
        if flag == "--heartbeat-interval":
            options.interval = value
        elif flag == "--heartbeat-backoff-cap":
            options.cap = value
        else:
            options.install[INSTALL_FLAGS[flag]] = value
    return options


def _install_settings(defaults: Settings, options: Options) -> Settings:
    """``defaults`` with what the command line gave."""
    import dataclasses  # not on the takeover's path

    from . import gpt

    given = options.install
    layout = defaults.layout
    if options.layout is not None:
        boot, system, data = options.layout
        layout = gpt.Layout(boot_mib=boot, system_mib=system, data_min_mib=data)
    return dataclasses.replace(
        defaults,
        download_deadline=given.get("download_deadline", defaults.download_deadline),
        backoff_start=given.get("backoff_start", defaults.backoff_start),
        backoff_cap=given.get("backoff_cap", defaults.backoff_cap),
        layout=layout,
        after_install=options.after_install or defaults.after_install,
    )


def main() -> int:
    if sys.argv[1:] == ["--wipe"]:
        from .wipe import main as wipe  # decommission only: not on a takeover's path

        return wipe(sys.argv[0])
    try:
        options = parse_args(sys.argv[1:])
    except (AgentError, ValueError) as exc:
        sys.stderr.write(f"agent: {exc}\n")
        return 2
    if options.init_file is not None:
        try:
            with open(options.init_file, "rb") as f:
                init_bytes = f.read(1 << 20)
        except OSError as exc:
            sys.stderr.write(f"agent: --init-file: {exc}\n")
            return 1
    else:
        init_bytes = sys.stdin.buffer.read()
    response = take_over(init_bytes, _beside(".key"))
    heartbeater: Heartbeater | None = None
    if options.interval is not None and iter_fields(response)[0][0] == 1:  # success
        from .heartbeat import Heartbeater  # the heartbeat's path only

        try:
            warnings: list[str] = []
            heartbeater = Heartbeater(
                TakeoverInit.decode(init_bytes),
                load_or_create_seed(_beside(".key"), warnings),
                interval=options.interval,
                backoff_cap=options.cap,
            )
        except AgentError as exc:
            response = encode_error(str(exc))
    if options.init_file is not None:  # systemd's start of the unit: no one to answer
        if heartbeater is None:
            sys.stderr.write(f"agent: cannot heartbeat with {options.init_file}\n")
            return 1
        return _heartbeat(heartbeater, options)
    if heartbeater is not None and options.systemd_unit:
        from . import unit

        try:
            unit.install_unit(
                os.path.abspath(sys.argv[0]), init_bytes, options.unit_flags, _systemd_root()
            )
        except AgentError as exc:
            response = take_over(
                init_bytes, _beside(".key"), [f"{exc}: the agent runs detached instead"]
            )
        else:
            sys.stdout.buffer.write(response)
            sys.stdout.buffer.flush()
            return 0
    sys.stdout.buffer.write(response)
    sys.stdout.buffer.flush()
    if heartbeater is None:
        return 0
    from .daemon import detach

    if not detach(_beside(".log"), _beside(".pid")):
        return 0
    return _heartbeat(heartbeater, options)


def _systemd_root() -> str:
    from .bootentry import Target

    return Target().systemd_root


def _heartbeat(heartbeater: Heartbeater, options: Options) -> int:
    """Heartbeat (and install) until killed; the daemon's and the unit's."""
    from .daemon import log, replace_running_agent
    from .hwreport import collect_hardware_report

    try:
        replace_running_agent(_beside(".pid"))
        log(f"heartbeating to {heartbeater.init.bmaas_endpoint} every {options.interval:g}s")
        agent = os.path.abspath(sys.argv[0])
        heartbeater.report = collect_hardware_report(os.path.dirname(agent))
        # After the takeover's answer: not on its path.
        from .install import Settings
        from .installer import Installer

        settings = _install_settings(Settings(), options)
        heartbeater.installer = Installer(
            agent,
            endpoint_scheme=heartbeater.scheme,
            ca_certificate=heartbeater.init.ca_certificate,
            settings=settings,
            wake=heartbeater.wake.set,
        )
        from .upgrade import Upgrader

        heartbeater.upgrader = Upgrader(
            agent,
            endpoint_scheme=heartbeater.scheme,
            ca_certificate=heartbeater.init.ca_certificate,
            settings=settings,
            wake=heartbeater.wake.set,
        )
        heartbeater.run()
    except BaseException as exc:  # the daemon's last word goes to its log
        log(f"stopped: {exc!r}")
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
