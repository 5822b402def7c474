"""The agent as a unit of the machine's own init: it comes back after a reboot.

With ``--systemd-unit`` (the initializer passes it for machines that run
systemd, `shepherd.agent_start.AgentConfig.systemd_unit`), a takeover does
not detach a daemon from the SSH session. It writes, beside the agent and in
the systemd root::

    <agent>.init                     the TakeoverInit it was given (0600)
    metropolis-agent.service         ExecStart=<agent> --init-file <agent>.init
                                     <the takeover's other flags>, Restart=always,
                                     its output appended to <agent>.log
    multi-user.target.wants/...      the enable symlink, last

then ``systemctl daemon-reload`` and ``systemctl restart --no-block`` of
the unit, and answers the takeover. systemd starts the heartbeating agent
now and at every boot; it reads its TakeoverInit from the file (its key is
the one beside it, as before), and its installer finds the install state
it left (`installer.Installer`), so after a reboot it reports the installed
generation again. A takeover again (after a recovery) rewrites the file and
restarts the unit. `remove_unit` (the wipe) stops the unit and removes all
three.

Errors: `AgentError` with the cause; the takeover then falls back to the
detached daemon and says so in a warning.
"""

from __future__ import annotations

import os
import re
import subprocess

from .errors import AgentError

AGENT_UNIT = "metropolis-agent.service"
#: What a path or flag in ExecStart may hold: no quoting, no specifiers.
_PLAIN = re.compile(r"[A-Za-z0-9_./,:=+-]+")


def _write(path: str, data: bytes, mode: int) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _systemctl(*args: str) -> None:
    try:
        done = subprocess.run(["systemctl", *args], capture_output=True, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AgentError(f"systemctl {' '.join(args)}: {exc}") from exc
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip()[-300:]
        raise AgentError(f"systemctl {' '.join(args)} failed (status {done.returncode}): {err}")


def unit_text(agent: str, flags: list[str]) -> str:
    """The unit running ``agent`` with ``flags`` and its saved TakeoverInit."""
    words = [agent, "--init-file", f"{agent}.init", *flags]
    bad = [w for w in words if not _PLAIN.fullmatch(w)]
    if bad:
        raise AgentError(f"cannot put {bad[0]!r} in a unit's ExecStart")
    return (
        "[Unit]\nDescription=Metropolis takeover agent\n\n"
        "[Service]\n"
        f"ExecStart={' '.join(words)}\n"
        "Restart=always\nRestartSec=2\n"
        # Only the agent: a node a loopback install started from it (not a
        # real disk's, which has its own unit) outlives an agent's restart.
        "KillMode=process\n"
        f"StandardOutput=append:{agent}.log\nStandardError=append:{agent}.log\n\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )


def install_unit(agent: str, init: bytes, flags: list[str], systemd_root: str) -> None:
    """Save ``init``, write and enable the unit, (re)start it (see the module)."""
    if not os.path.isdir("/run/systemd/system"):
        raise AgentError("systemd does not run this machine")
    text = unit_text(agent, flags)
    try:
        _write(f"{agent}.init", init, 0o600)
        _write(os.path.join(systemd_root, AGENT_UNIT), text.encode(), 0o644)
        wants = os.path.join(systemd_root, "multi-user.target.wants")
        os.makedirs(wants, exist_ok=True)
        link = os.path.join(wants, AGENT_UNIT)
        if os.path.lexists(f"{link}.tmp"):
            os.unlink(f"{link}.tmp")
        os.symlink(os.path.join(systemd_root, AGENT_UNIT), f"{link}.tmp")
        os.replace(f"{link}.tmp", link)
    except OSError as exc:
        raise AgentError(f"cannot write the agent's unit: {exc}") from exc
    _systemctl("daemon-reload")
    _systemctl("restart", "--no-block", AGENT_UNIT)


def remove_unit(agent: str, systemd_root: str) -> tuple[list[str], list[str]]:
    """Stop the agent's unit and remove it, its enable symlink and the saved
    TakeoverInit: (the paths removed, the errors). Nothing when there is none."""
    unit = os.path.join(systemd_root, AGENT_UNIT)
    paths = [os.path.join(systemd_root, "multi-user.target.wants", AGENT_UNIT), unit]
    if not any(os.path.lexists(p) for p in paths):
        return [], []
    errors = []
    if os.path.isdir("/run/systemd/system"):
        try:
            _systemctl("stop", AGENT_UNIT)
        except AgentError as exc:
            errors.append(str(exc))
    removed = []
    for path in [*paths, f"{agent}.init"]:
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            errors.append(f"cannot remove {path}: {exc}")
    if os.path.isdir("/run/systemd/system"):
        try:
            _systemctl("daemon-reload")
        except AgentError as exc:
            errors.append(str(exc))
    return removed, errors
