"""One machine: a ``systemd-nspawn --boot`` container with systemd as PID 1.

Its root is an overlay: the cached Debian tree (`shepherd.nspawn.rootfs`)
below, the machine's own folder above, so what the machine writes stays
across its boots and never reaches the cache. Before the first boot the
upper layer gets the machine's hostname, machine id, a fresh Ed25519 SSH
host key (the only one its sshd offers) and ``/root/.ssh/authorized_keys``
with the given keys.

Each boot runs::

    systemd-nspawn --boot --register=no --keep-unit -D ROOT -M NAME
        --private-network --network-namespace-path=/run/netns/NS
        --drop-capability=CAP_NET_ADMIN --bind=/dev/loopN
        --kill-signal=SIGRTMIN+4 --console=pipe ...

``--register=no --keep-unit``: the host has no systemd (no machined, no bus),
without them nspawn fails. Power follows what a BMC offers
(`shepherd.nspawn.bmc`):

* `power_on` starts nspawn; a supervising task waits for it. When nspawn
  exits with 133 (systemd-nspawn's status for a reboot asked from inside,
  e.g. ``systemctl reboot``) the task starts it again at once; any other
  exit leaves the machine off.
* `shutdown` sends nspawn SIGTERM, which it passes to the machine's systemd
  as ``--kill-signal`` SIGRTMIN+4 (an orderly poweroff); `graceful_restart`
  sends systemd SIGRTMIN+5 (an orderly reboot, so a 133 exit).
* `force_off` kills the machine's PID 1 (which ends every process of its PID
  namespace), then nspawn if it lingers; `force_restart` is that, then on.

Console output (and nspawn's own messages) go to ``<folder>/console.log``.
The caller's nursery runs the supervising tasks (`Machine` takes it);
`close` (after power off) unmounts the overlay. Errors: `MachineError`.
"""

from __future__ import annotations

import enum
import logging
import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import trio

from shepherd.errors import ShepherdError
from shepherd.nspawn.disk import LoopDisk
from shepherd.nspawn.network import Link
from shepherd.nspawn.rootfs import RootImage

__all__ = ["REBOOT_STATUS", "Machine", "MachineError", "MachineSpec", "Power"]

logger = logging.getLogger("shepherd.nspawn.machine")

#: systemd-nspawn's exit status when the container asked for a reboot.
REBOOT_STATUS = 133
#: How long an orderly poweroff may take before it is forced.
SHUTDOWN_TIMEOUT = 30.0


class MachineError(ShepherdError):
    """Preparing, starting or stopping a machine failed."""


class Power(enum.Enum):
    ON = "On"
    OFF = "Off"


@dataclass(frozen=True)
class MachineSpec:
    """What one machine is made of."""

    #: nspawn's machine name; unique on the host (nspawn keeps per-name state in /run).
    name: str
    hostname: str
    folder: Path
    image: RootImage
    link: Link
    disk: LoopDisk
    authorized_keys: tuple[str, ...]


class Machine:
    """One machine's power and processes. Off until `power_on`."""

    def __init__(self, spec: MachineSpec, nursery: trio.Nursery) -> None:
        self.spec = spec
        self._nursery = nursery
        self._process: trio.Process | None = None
        self._want_on = False
        self._off = trio.Event()
        self._off.set()
        self._mounted = False
        #: Boots so far (a reboot from inside counts).
        self.boots = 0
        #: nspawn's exit status of the last boot that ended (None: none ended yet).
        self.last_status: int | None = None

    @property
    def root(self) -> Path:
        return self.spec.folder / "root"

    @property
    def console_log(self) -> Path:
        return self.spec.folder / "console.log"

    @property
    def power(self) -> Power:
        return Power.OFF if self._off.is_set() else Power.ON

    # --- the root -------------------------------------------------------

    def prepare(self) -> None:
        """Mount the overlay and give a first-time upper layer its identity.
        Blocking; idempotent."""
        if self._mounted:
            return
        folder = self.spec.folder
        upper, work = folder / "upper", folder / "work"
        first = not upper.exists()
        for path in (upper, work, self.root):
            path.mkdir(parents=True, exist_ok=True)
        _run(
            "mount", "-t", "overlay", "overlay", "-o",
            f"lowerdir={self.spec.image.tree},upperdir={upper},workdir={work}", str(self.root),
        )  # fmt: skip
        self._mounted = True
        if first:
            etc = self.root / "etc"
            (etc / "hostname").write_text(self.spec.hostname + "\n")
            (etc / "machine-id").write_text(secrets.token_hex(16) + "\n")
            _host_key(self.root)
        ssh = self.root / "root" / ".ssh"
        ssh.mkdir(mode=0o700, exist_ok=True)
        keys = ssh / "authorized_keys"
        keys.write_text("".join(k.strip() + "\n" for k in self.spec.authorized_keys))
        keys.chmod(0o600)

    def close(self) -> None:
        """Unmount the overlay (the machine must be off). Blocking; idempotent."""
        if not self._off.is_set():
            raise RuntimeError(f"machine {self.spec.name} is still on")
        if self._mounted:
            _run("umount", str(self.root))
            self._mounted = False
        shutil.rmtree(f"/run/systemd/nspawn/propagate/{self.spec.name}", ignore_errors=True)

    # --- power ------------------------------------------------------------

    def _command(self) -> list[str]:
        return [
            "systemd-nspawn",
            "--boot",
            "--register=no",
            "--keep-unit",
            "--quiet",
            f"--directory={self.root}",
            f"--machine={self.spec.name}",
            # With --private-network too, nspawn mounts a /sys of the
            # machine's own namespace: without it /sys/class/net lists the
            # host's links (a hardware report would show the host's NICs).
            "--private-network",
            f"--network-namespace-path={self.spec.link.namespace_path}",
            # --private-network grants it; the machine may not add a route
            # beyond the bridge or change its address.
            "--drop-capability=CAP_NET_ADMIN",
            f"--bind={self.spec.disk.device}",
            "--kill-signal=SIGRTMIN+4",
            "--console=pipe",
            "--link-journal=no",
            "--resolv-conf=off",
            "--timezone=off",
        ]

    async def power_on(self) -> None:
        """Start the machine if it is off (returns once nspawn runs, not booted)."""
        if not self._off.is_set():
            return
        await trio.to_thread.run_sync(self.prepare)
        self._want_on = True
        self._off = trio.Event()
        await self._nursery.start(self._supervise)

    async def _supervise(self, task_status: trio.TaskStatus[None]) -> None:
        started = False
        try:
            while self._want_on:
                with self.console_log.open("ab") as log:
                    try:
                        process = await trio.lowlevel.open_process(
                            self._command(),
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            # Not in our process group: an operator's Ctrl-C
                            # is ours to handle (an orderly stop), not nspawn's.
                            start_new_session=True,
                        )
                    except OSError as exc:
                        raise MachineError(f"cannot run systemd-nspawn: {exc}") from exc
                self._process = process
                self.boots += 1
                logger.info("machine %s: boot %d (pid %d)", self.spec.name, self.boots, process.pid)
                if not started:
                    task_status.started()
                    started = True
                status = await process.wait()
                self._process = None
                self.last_status = status
                if status != REBOOT_STATUS:
                    logger.info("machine %s: off (nspawn exited %d)", self.spec.name, status)
                    break
                logger.info("machine %s: rebooting", self.spec.name)
        finally:
            self._want_on = False
            self._off.set()
            if not started:
                task_status.started()

    def container_pid(self) -> int | None:
        """The host's pid of the machine's PID 1 (systemd), if it runs."""
        process = self._process
        if process is None:
            return None
        try:
            children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text()
        except OSError:
            return None
        pids = [int(p) for p in children.split()]
        return pids[0] if pids else None

    async def wait_off(self) -> None:
        await self._off.wait()

    async def shutdown(self, grace: float = SHUTDOWN_TIMEOUT) -> bool:
        """An orderly poweroff; forced after ``grace`` s. Returns True if it was
        orderly. Returns when the machine is off, also when it was already off."""
        self._want_on = False
        process = self._process
        if process is not None:
            process.send_signal(signal.SIGTERM)
        with trio.move_on_after(grace):
            await self._off.wait()
            return True
        logger.warning("machine %s: no poweroff within %s s, forcing", self.spec.name, grace)
        await self.force_off()
        return False

    async def force_off(self) -> None:
        """Power cut: kill the machine's PID 1, then nspawn. Returns when off."""
        self._want_on = False
        pid = self.container_pid()
        if pid is not None:
            with _gone_ok():
                os.kill(pid, signal.SIGKILL)
        with trio.move_on_after(10):
            await self._off.wait()
            return
        process = self._process
        if process is not None:
            with _gone_ok():
                process.kill()
        await self._off.wait()

    async def force_restart(self) -> None:
        await self.force_off()
        await self.power_on()

    def graceful_restart(self) -> None:
        """Ask the machine's systemd for an orderly reboot (returns at once)."""
        pid = self.container_pid()
        if pid is None:
            raise MachineError(f"machine {self.spec.name} is not running")
        os.kill(pid, signal.SIGRTMIN + 5)

    async def wait_sshd(self, within: float = 60.0) -> None:
        """Wait until the machine's sshd sends its banner. `MachineError` after ``within`` s."""
        address = str(self.spec.link.address)
        with trio.move_on_after(within):
            while True:
                try:
                    stream = await trio.open_tcp_stream(address, 22)
                except OSError:
                    await trio.sleep(0.1)
                    continue
                async with stream:
                    with trio.move_on_after(5):
                        if (await stream.receive_some(64)).startswith(b"SSH-"):
                            return
                await trio.sleep(0.1)
        raise MachineError(f"machine {self.spec.name}: no sshd at {address}:22 within {within} s")


class _gone_ok:
    """Ignore ProcessLookupError: the process was already gone."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> bool:
        return kind is not None and issubclass(kind, ProcessLookupError)


def _run(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise MachineError(f"{' '.join(args)}: {result.stderr.strip()}")


def _host_key(root: Path) -> None:
    """Give the machine of ``root`` one Ed25519 SSH host key, and make its
    sshd offer only that one (blocking)."""
    ssh = root / "etc" / "ssh"
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f",
         str(ssh / "ssh_host_ed25519_key"))  # fmt: skip
    # Debian's sshd_config includes this folder first; with a HostKey
    # named, sshd looks for no other (and logs no missing ones).
    (ssh / "sshd_config.d").mkdir(exist_ok=True)
    (ssh / "sshd_config.d" / "10-host-key.conf").write_text(
        "HostKey /etc/ssh/ssh_host_ed25519_key\n"
    )
