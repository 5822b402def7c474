"""Upgrading a loopback disk: the new image as the inactive slot's file, the
slot activated, and the boots played by the agent (`LoopbackBoots`).

A loopback disk (`loopnode`) has no boot: ``image.pyz`` is slot A,
``image-b.pyz`` slot B, and the slot state is ``slots.json`` in its folder
(`abslots.FolderStore`). `write_folder` and `activate_folder` are
`upgradedevice`'s write and activation for it. Then `LoopbackBoots` plays
what a real machine's boots do: it stops the node, lets `abslots.boot`
choose the slot, starts the node from it (``node run``), and runs the boot
check: healthy in time, the slot is kept; else (or the node exits) it
"reboots", and the boot goes back.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import time

from . import abslots
from .abslots import SlotError, SlotImage
from .daemon import log
from .errors import UpgradeFailed
from .loopnode import IMAGE, ROOT, SLOT_B_IMAGE, node_running, spawn
from .upgradedevice import device_outcome

#: Seconds a loopback node is given to stop after SIGTERM before SIGKILL.
STOP_TIMEOUT = 30.0


def slot_file(disk: str, slot: str) -> str:
    """A loopback disk's file of ``slot``."""
    return os.path.join(disk, IMAGE if slot == "a" else SLOT_B_IMAGE)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_folder(disk: str, image: str, digest: str) -> tuple[str, int]:
    """`upgradedevice.write_device` for a loopback disk: ``image`` (a downloaded file in
    ``disk``) becomes the inactive slot's file; (the slot, its size)."""
    store = abslots.FolderStore(disk)
    state = store.read() or folder_installed(disk)
    if state.next is not None:
        raise UpgradeFailed(f"a try of slot {state.next} is staged or under way on {disk}")
    slot = abslots.other(state.active)
    size = os.path.getsize(image)
    abslots.crash_point("upgrade-image")
    os.replace(image, slot_file(disk, slot))
    return slot, size


def activate_folder(disk: str, slot: str, digest: str, size: int, health_timeout: float) -> None:
    """`upgradedevice.activate_device` for a loopback disk."""
    store = abslots.FolderStore(disk)
    state = store.read() or folder_installed(disk)
    if state.next is not None:
        raise UpgradeFailed(f"a try of slot {state.next} is staged or under way on {disk}")
    if slot != abslots.other(state.active):
        raise UpgradeFailed(f"slot {slot} of {disk} is the active slot now")
    path = slot_file(disk, slot)
    try:
        if os.path.getsize(path) != size or _sha256(path) != digest:
            raise UpgradeFailed(f"the file of slot {slot} of {disk} is not {digest[:12]}")
    except OSError as exc:
        raise UpgradeFailed(f"slot {slot} of {disk}: {exc.strerror}") from exc
    abslots.crash_point("upgrade-state")
    try:
        store.write(abslots.stage(state, SlotImage(digest, size), health_timeout))
    except SlotError as exc:
        raise UpgradeFailed(str(exc)) from exc
    abslots.crash_point("upgrade-staged")


def stage_folder(disk: str, image: str, digest: str, health_timeout: float) -> str:
    """`write_folder`, then `activate_folder`: the slot."""
    slot, size = write_folder(disk, image, digest)
    activate_folder(disk, slot, digest, size, health_timeout)
    return slot


def folder_installed(disk: str) -> abslots.SlotState:
    """A loopback disk's state before its first upgrade: slot a is ``image.pyz``."""
    path = slot_file(disk, "a")
    try:
        return abslots.initial(SlotImage(_sha256(path), os.path.getsize(path)))
    except OSError as exc:
        raise UpgradeFailed(f"{disk} holds no installed image: {exc.strerror}") from exc


class LoopbackBoots:
    """The boots of a loopback disk, played by the agent (see the module)."""

    def __init__(self, disk: str, python: str, *, stop_timeout: float = STOP_TIMEOUT) -> None:
        self.disk = disk
        self.python = python
        self.stop_timeout = stop_timeout
        self.store = abslots.FolderStore(disk)
        self._process: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        """Stop the disk's node (SIGTERM, SIGKILL after the bound), if one runs."""
        pid = node_running(self.disk)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        while node_running(self.disk) == pid and time.monotonic() < deadline:
            time.sleep(0.05)
        if node_running(self.disk) == pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while node_running(self.disk) == pid:
                time.sleep(0.05)

    def _extract(self, slot: str, image: SlotImage) -> None:
        path = slot_file(self.disk, slot)
        try:
            ok = os.path.getsize(path) == image.size and _sha256(path) == image.sha256
        except OSError as exc:
            raise SlotError(f"slot {slot}: {exc.strerror}") from exc
        if not ok:
            raise SlotError(f"the image of slot {slot} does not match its SHA-256")

    def boot(self) -> abslots.Boot:
        """One "boot": the node stopped, its run-time files gone, a slot chosen
        (`abslots.boot`), the node started from it."""
        self.stop()
        for name in (abslots.BOOT_INFO, abslots.HEALTHY):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.disk, name))
        chosen = abslots.boot(
            self.store, lambda: folder_installed(self.disk), self._extract, self.disk
        )
        self._start(chosen.slot)
        return chosen

    def _start(self, slot: str) -> None:
        argv = [
            self.python,
            slot_file(self.disk, slot),
            "node",
            "run",
            "--root",
            os.path.join(self.disk, ROOT),
            "--boot-info",
            os.path.join(self.disk, abslots.BOOT_INFO),
            "--announce-healthy",
            os.path.join(self.disk, abslots.HEALTHY),
        ]
        self._process = spawn(self.disk, argv)

    def alive(self) -> bool:
        process = self._process
        return process is not None and process.poll() is None

    def prewarm(self, slot: str, timeout: float = 300.0) -> None:
        """Start ``slot``'s image once for its ``--help``, while the old node
        still serves: a node image (shiv) unpacks and compiles its modules at
        its first start, seconds that would otherwise fall inside the node's
        downtime. Best effort: a failure here is the boot's to find."""
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                [self.python, slot_file(self.disk, slot), "node", "--help"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                cwd=self.disk,
                timeout=timeout,
                check=False,
            )

    def settle(self, digest: str, *, poll: float = 0.2) -> tuple[int, str]:
        """Boot, check, and boot again when the check gives up: the outcome of
        the try of ``digest`` (hex), as `device_outcome` says it."""
        chosen = self.boot()
        if chosen.trial:
            outcome = abslots.check(
                self.store, self.disk, self._reboot, poll=poll, log=log, alive=self.alive
            )
            if outcome == "rebooted":
                self.boot()
        state = self.store.read()
        if state is None:
            raise SlotError(f"{self.disk} has no slot state after its boot")
        return device_outcome(state, digest)

    def _reboot(self) -> None:
        """The check's "reboot" is the next `boot` (in `settle`): nothing here."""
