"""Wiping a machine being decommissioned: ``agent --wipe``.

The Shepherd's decommissioner runs the uploaded agent once more, over SSH,
with ``--wipe`` (nothing on stdin). In order:

    stop the agent's unit          if the takeover made one (`unit`): stopped,
                                   removed with its saved TakeoverInit, so
                                   that systemd does not start it again
    stop the heartbeating agent    its pid file names it; only a process
                                   whose command line names this agent file
                                   is signalled (as `daemon.replace_running_agent`)
    stop each installed node       a loopback disk's node.pid, if that process
                                   runs the disk's image (`loopnode.node_running`):
                                   SIGTERM, then SIGKILL after a bound
    empty each loopback disk       everything an install wrote in the folder
                                   that stands for the disk (the folder stays:
                                   it is the disk)
    wipe the installed real disk   the device the install state names: the node's
                                   units stopped, its data unmounted, the boot
                                   entry removed (enable symlink first:
                                   `bootentry.stop_installed`), then
                                   `diskwipe.wipe_device`: wipefs of each
                                   partition, then of the table, blkdiscard
                                   (a zero-out of the whole device where a
                                   discard does not zero it), read back
    remove the agent's own files   its key, pid file and install state

and prints one JSON object on stdout: ``{"wiped": [paths], "stopped":
[pids], "errors": [lines], "steps": ["what: outcome", ...]}`` (``steps``:
the unit's and the disk's, each with its outcome). The exit status is 0 when nothing failed, 1
otherwise (the report still says what was done). The agent's log and the
agent file itself stay: the log tells what happened, and the file is what
ran. Running it again on a wiped machine wipes nothing and succeeds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time

from . import blockdev, bootentry, diskwipe, unit
from .disks import loopback_disks
from .files import read_int, read_text
from .loopnode import node_running

#: Seconds a node or agent is given to stop after SIGTERM before SIGKILL.
STOP_TIMEOUT = 10.0

#: Files beside the agent (``<agent><suffix>``) that a wipe removes.
OWN_FILES = (".key", ".pid", ".install.json", ".upgrade.json")


def _stop(pid: int, stopped: list[int], errors: list[str]) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    except OSError as exc:
        errors.append(f"cannot stop pid {pid}: {exc}")
        return
    deadline = time.monotonic() + STOP_TIMEOUT
    while time.monotonic() < deadline:
        if not _alive(pid):
            stopped.append(pid)
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    stopped.append(pid)


def _alive(pid: int) -> bool:
    stat = read_text(f"/proc/{pid}/stat")
    if stat is None:
        return False
    fields = stat.rpartition(")")[2].split()
    return bool(fields) and fields[0] != "Z"


def _remove(path: str, wiped: list[str], errors: list[str]) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        errors.append(f"cannot remove {path}: {exc}")
        return
    wiped.append(path)


def _installed_device(agent: str) -> str | None:
    try:
        with open(agent + ".install.json", "rb") as f:
            state = json.loads(f.read(64 * 1024))
    except (OSError, ValueError):
        return None
    device = state.get("device") if isinstance(state, dict) else None
    return device if isinstance(device, str) and device else None


def _wipe_device(
    device: str, target: bootentry.Target, steps: list[str], errors: list[str]
) -> None:
    try:
        stopped = bootentry.stop_installed(target)
        steps.extend(f"{step}: done" for step in stopped)
        if not stopped:  # a unit half written (a cut install) is still removed
            steps.extend(f"removed {p}: done" for p in bootentry.remove_boot_entry(target))
    except (OSError, blockdev.DeviceFailed) as exc:
        errors.append(f"cannot stop the installed node: {exc}")
        steps.append(f"stop the installed node: failed: {exc}")
        return  # its data is mounted: wiping under it would fail half way
    try:
        steps.extend(diskwipe.wipe_device(device))
    except (OSError, blockdev.DeviceFailed) as exc:
        errors.append(f"cannot wipe {device}: {exc}")
        steps.append(f"wipe {device}: failed: {exc}")


def wipe(agent: str, target: bootentry.Target | None = None) -> dict[str, list[object]]:
    """Wipe what the agent at path ``agent`` and its installs wrote; the report.
    ``target``: where a real install's boot entry is (`bootentry.Target` by default)."""
    agent = os.path.abspath(agent)
    target = target or bootentry.Target()
    wiped: list[str] = []
    stopped: list[int] = []
    errors: list[str] = []
    steps: list[str] = []
    # systemd would start the agent again if it were only signalled.
    removed, unit_errors = unit.remove_unit(agent, target.systemd_root)
    if removed or unit_errors:
        steps.append(
            f"stopped and removed {unit.AGENT_UNIT}: " + ("; ".join(unit_errors) or "done")
        )
    wiped.extend(removed)
    errors.extend(unit_errors)
    running = read_int(agent + ".pid")
    if running and running != os.getpid():
        cmdline = (read_text(f"/proc/{running}/cmdline") or "").split("\0")
        if any(os.path.abspath(arg) == agent for arg in cmdline if arg):
            _stop(running, stopped, errors)
    for disk in sorted(loopback_disks(os.path.dirname(agent)).values()):
        node = node_running(disk)
        if node is not None:
            _stop(node, stopped, errors)
        for name in sorted(os.listdir(disk)):
            _remove(os.path.join(disk, name), wiped, errors)
    device = _installed_device(agent)
    if device is not None:
        _wipe_device(device, target, steps, errors)
    for suffix in OWN_FILES:
        _remove(agent + suffix, wiped, errors)
    return {
        "wiped": list(wiped),
        "stopped": list(stopped),
        "errors": list(errors),
        "steps": list(steps),
    }


def main(agent: str) -> int:
    """``agent --wipe``: wipe, print the report, 0 if nothing failed."""
    report = wipe(agent)
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    return 1 if report["errors"] else 0
