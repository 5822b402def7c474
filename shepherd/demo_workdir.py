"""The demo's working folder: its layout, what the demo may remove from it,
and the processes that run from it.

Every entry the demo makes is in `_DEMO_ENTRIES`; `Workdir.remove` removes
those (or the folders the demo created) and nothing else. The names are
short because the nodes' UNIX sockets live under them:
`check_workdir_length` refuses a folder whose longest socket path would not
fit. `reap` waits until no process runs from the fleet's or the first
node's folders.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

import trio

from metropolis.consensus.process import SOCKET_NAME
from metropolis.localstorage import Root
from shepherd.agent.loopnode import ROOT as NODE_ROOT
from shepherd.errors import ShepherdError
from shepherd.localfleet import DISK, machine_root, stop_agent, stop_node

logger = logging.getLogger("shepherd.demo_workdir")


#: The working folder's entries (short: they hold the nodes' UNIX sockets).
MACHINES_DIR, BROKEN_DIR, FIRST_DIR = "m", "b", "first"

#: Longest UNIX socket path usable by every program here: ``sun_path`` has
#: 108 bytes and etcd (Go) needs one of them for the terminating NUL.
MAX_SOCKET_PATH = 107

#: Seconds a process of the demo has to exit after SIGTERM before SIGKILL.
STOP_GRACE = 15.0


def longest_socket_path(workdir: Path, machines: int, *, nodes: bool = True) -> Path:
    """The longest UNIX socket path the demo in ``workdir`` makes: with
    ``nodes``, the etcd client socket of a node installed on the last
    machine's disk (deeper than the first node's); without, PostgreSQL's."""
    candidates = [workdir / "postgres" / "socket" / ".s.PGSQL.65535"]
    if nodes:
        disk = machine_root(workdir / MACHINES_DIR, max(machines - 1, 0), prefix="") / DISK
        candidates += [
            Root(disk / NODE_ROOT).ephemeral.consensus / SOCKET_NAME,
            Root(workdir / FIRST_DIR).ephemeral.consensus / SOCKET_NAME,
        ]
    return max(candidates, key=lambda p: len(os.fsencode(p)))


def check_workdir_length(workdir: Path, machines: int, *, nodes: bool = True) -> None:
    """`WorkdirError` if a socket path under ``workdir`` would be too long."""
    path = longest_socket_path(workdir, machines, nodes=nodes)
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH:
        what = "a node's etcd socket" if nodes else "PostgreSQL's socket"
        raise WorkdirError(
            f"--workdir {workdir}: too long by {size - MAX_SOCKET_PATH} bytes: {what} "
            f"would be {path} ({size} bytes; a UNIX socket path has at most "
            f"{MAX_SOCKET_PATH})"
        )


def processes_under(folder: Path) -> list[int]:
    """Pids of processes (not this one, nor its ancestors) whose command
    line names a path under ``folder``."""
    mine = {os.getpid()}
    pid = os.getppid()
    while pid > 1:
        mine.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    prefix = os.fsencode(folder)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
        except OSError:
            continue
        if any(arg.startswith(prefix) or b"=" + prefix in arg for arg in cmdline.split(b"\0")):
            found.append(int(entry))
    return found


async def reap(workdir: Path) -> None:
    """Wait until no process runs from the fleet's or the first node's
    folders (agents, nodes, their etcd); SIGKILL what is left after
    `STOP_GRACE` seconds. The caller shields it."""
    folders = [workdir / MACHINES_DIR, workdir / BROKEN_DIR, workdir / FIRST_DIR]
    # Again: an agent stopped mid-install may have started its node after
    # the first round of stops.
    for agent in (workdir / MACHINES_DIR).glob("*/root/agent"):
        stop_agent(agent)
    for disk in (workdir / MACHINES_DIR).glob(f"*/{DISK}"):
        stop_node(disk)

    def left() -> list[int]:
        return [pid for folder in folders for pid in processes_under(folder)]

    with trio.move_on_after(STOP_GRACE):
        while left():  # noqa: ASYNC110  (other processes: nothing to wait on but /proc)
            await trio.sleep(0.1)
        return
    for pid in left():
        logger.warning("process %d still runs from %s: killing it", pid, workdir)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


#: What the demo puts into its working folder; nothing else there is ever removed.
_DEMO_ENTRIES = (
    "postgres",
    MACHINES_DIR,
    BROKEN_DIR,
    FIRST_DIR,
    "first.log",
    "owner.pem",
    "web.log",
    "machines.toml",
    "shepherd_ed25519",
    "r",  # --real-machines (shepherd.demo_real.REAL_DIR)
)


class WorkdirError(ShepherdError):
    """The folder given with ``--workdir`` cannot be used; nothing was changed."""


@dataclass(frozen=True)
class Workdir:
    """The demo's working folder and how much of it the demo may remove.

    ``created`` is the outermost folder the demo created itself (``path`` or
    one of its ancestors), removed whole at the end. When it is ``None`` the
    folder was the user's (it existed, empty): the demo removes only the
    entries it put there and never changes the folder's own mode.
    """

    path: Path
    created: Path | None

    @classmethod
    def prepare(cls, requested: Path | None) -> Workdir:
        if requested is None:
            path = Path(tempfile.mkdtemp(prefix="shepherd-demo-"))
            # As root, PostgreSQL runs as the postgres user, which must reach
            # its folder inside ours (mkdtemp makes ours 0700).
            path.chmod(0o711)
            return cls(path, created=path)
        path = requested.absolute()
        if path.is_symlink() or path.exists():
            if not path.is_dir() or path.is_symlink():
                raise WorkdirError(f"--workdir {requested}: exists and is not a folder")
            if any(path.iterdir()):
                raise WorkdirError(
                    f"--workdir {requested}: folder is not empty; give a new or empty folder"
                    " (the demo removes what it creates, so it will not share a folder)"
                )
            return cls(path, created=None)
        outermost = path
        while not outermost.parent.exists():
            outermost = outermost.parent
        path.mkdir(parents=True)
        return cls(path, created=outermost)

    def remove(self) -> None:
        """Remove what the demo created, and nothing else."""
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
            return
        for name in _DEMO_ENTRIES:
            entry = self.path / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
