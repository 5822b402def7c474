"""The node of a loopback disk: the files an install writes in the disk's
folder, and the node process started from them and watched.

A loopback disk (`disks`) is a folder; an install writes there
``image.pyz``, ``node-parameters.pb`` and the node's root ``metropolis/``,
starts the node detached (own session, stdin /dev/null, output to
``node.log``, pid in ``node.pid``: it outlives the agent, which never
signals it; an upgrade's loopback boots stop it) and waits for its key in
``node.key.pub``. An upgrade adds slot B's image and the slot state there
(`abslots`); `clear_disk` removes all of it before the next install.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .download import PART_PREFIX, PART_SUFFIX
from .errors import InstallFailed
from .files import remove, write_atomically

if TYPE_CHECKING:
    import subprocess

    from .installplan import Plan

# What an install writes on the disk folder, and what it removes there first.
IMAGE, PARAMETERS, ROOT = "image.pyz", "node-parameters.pb", "metropolis"
PID, LOG, KEY, DISK_STATE = "node.pid", "node.log", "node.key.pub", "install.json"
#: What an upgrade adds there (`upgrade`, `abslots`): slot B's image, the
#: slot state, and the boot's and the node's run-time files. Removed too.
SLOT_B_IMAGE = "image-b.pyz"
UPGRADE_FILES = (SLOT_B_IMAGE, "slots.json", "boot.json", "healthy.json")


def clear_disk(disk: str, *, keep: str) -> None:
    """Remove what an earlier install (or an interrupted download) left, but ``keep``."""
    import shutil

    for name in (IMAGE, PARAMETERS, PID, LOG, KEY, DISK_STATE, *UPGRADE_FILES):
        remove(os.path.join(disk, name))
    root = os.path.join(disk, ROOT)
    if os.path.lexists(root):
        if os.path.islink(root) or not os.path.isdir(root):
            remove(root)
        else:
            shutil.rmtree(root)
    remove_parts(disk, keep=keep)


def remove_parts(disk: str, *, keep: str = "") -> None:
    """Remove the temporary files of downloads into ``disk`` (but ``keep``)."""
    for name in os.listdir(disk):
        path = os.path.join(disk, name)
        if name.startswith(PART_PREFIX) and name.endswith(PART_SUFFIX) and path != keep:
            remove(path)


def node_running(disk: str) -> int | None:
    """The pid of the node started from ``disk``'s image (either slot's, after an
    upgrade) that still runs, if any."""
    try:
        with open(os.path.join(disk, PID)) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().split(b"\0")
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    images = {os.path.join(disk, name).encode() for name in (IMAGE, SLOT_B_IMAGE)}
    return pid if images & set(cmdline) and state != b"Z" else None


def log_tail(path: str, *, lines: int = 10, width: int = 300) -> str:
    """The last lines of a log, escaped (control characters as Python escapes)
    and bounded, on one line: for an error report."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(no log: {exc.strerror})"
    tail = [repr(line)[1:-1][:width] for line in text.splitlines()[-lines:] if line.strip()]
    return " | ".join(tail) if tail else "(the log is empty)"


def read_key(path: str) -> bytes | None:
    """The node's announced key in file ``path``, None before it is there;
    InstallFailed if it is no regular file of 32 bytes."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise InstallFailed(f"{path} is not a regular file")
    with open(path, "rb") as f:
        key = f.read(33)
    if len(key) != 32:
        raise InstallFailed(f"the node's announce-key file holds {len(key)} bytes, want 32")
    return key


def await_key(disk: str, alive: Callable[[], bool], timeout: float) -> bytes:
    """Wait for the node's key file, while the node runs, at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    path = os.path.join(disk, KEY)
    while True:
        running = alive()  # before the read: a node that wrote its key and exited counts
        key = read_key(path)
        if key is not None:
            return key
        if not running:
            raise InstallFailed(
                f"the node exited before announcing its key: {log_tail(os.path.join(disk, LOG))}"
            )
        if time.monotonic() > deadline:
            raise InstallFailed(
                f"the node did not announce its key within {timeout:g}s (it keeps running): "
                f"{log_tail(os.path.join(disk, LOG))}"
            )
        time.sleep(0.05)


def start_node(plan: Plan, python: str) -> Callable[[], bool]:
    """Start the node detached from the agent; return "is it still running"."""
    disk = plan.disk
    argv = [
        python,
        os.path.join(disk, IMAGE),
        "node",
        "register",
        "--parameters",
        os.path.join(disk, PARAMETERS),
        "--root",
        os.path.join(disk, ROOT),
        "--address",
        plan.node_address,
        "--insecure-seal",
        "--announce-key",
        os.path.join(disk, KEY),
    ]
    process = spawn(disk, argv)
    return lambda: process.returncode is None and node_running(disk) is not None


def spawn(disk: str, argv: list[str]) -> subprocess.Popen[bytes]:
    """Start ``argv`` (a node of ``disk``) detached from the agent, its output
    appended to the disk's log, its pid in the disk's pid file, reaped by a
    thread of its own when it exits."""
    import subprocess

    out = os.open(
        os.path.join(disk, LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
    )
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=disk,
            start_new_session=True,  # its own session: no signal of the agent's reaches it
            close_fds=True,
        )
    finally:
        os.close(out)
    write_atomically(os.path.join(disk, PID), f"{process.pid}\n".encode())
    # Reaped when it exits, so that no zombie stays behind while the agent runs.
    threading.Thread(target=process.wait, name="node-reaper", daemon=True).start()
    return process


def write_disk_state(disk: str, state: dict[str, object]) -> None:
    """The disk's own ``install.json``: which generation installed what on it."""
    write_atomically(os.path.join(disk, DISK_STATE), json.dumps(state).encode() + b"\n")
