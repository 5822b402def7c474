"""Upgrading the installed node to another image, as a heartbeat answer's upgrade request asks.

The A/B machine itself (what is written when, what a crash leaves, what the
next boot does) is `abslots`'s; this module is the agent's side of it.
`Upgrader` works like `installer.Installer`: told each accepted heartbeat's
upgrade request (`Upgrader.on_answer`), it starts a request of a new
generation once, in a worker thread, records it in ``<agent>.upgrade.json``
before any side effect (a generation is never run twice, across restarts
too), and says what the next heartbeat reports (`Upgrader.pending_report`)
for as long as the server carries that generation. Unlike an install, an
upgrade reports as it goes: WRITTEN, STAGED, then COMMITTED or ROLLED_BACK
(FAILED when nothing changed on the machine).

A request without ``activate`` only writes: the image on the inactive slot,
read back, reported WRITTEN, and nothing points at it (the node keeps
serving; a Shepherd asks every machine of a run for this at once). The
same generation carried later with ``activate`` stages the written slot
(read back again, not written again) and reboots. A request of a new
generation with ``activate`` does both in a row.

One upgrade::

    check the request     the image (as an install's), a health timeout
                          within bounds, the root device the install used:
                          the block device the install state names, or a
                          loopback disk with an installed node
    download, verify      beside the agent (real disk) or in the disk's
                          folder, its SHA-256 checked before any use
    stage                 real disk: `stage_device`: the inactive slot written
                            raw, read back; the helpers and the boot check
                            refreshed; the slot state points at it for the
                            next boot only
                          loopback disk (`stage_folder`): the inactive slot's
                            file (``image.pyz`` is A, ``image-b.pyz`` B), the
                            slot state in ``slots.json``
                          split in two: `write_device` / `write_folder`
                            (report WRITTEN; stop here until activated),
                            `activate_device` / `activate_folder` (the slot
                            read back, the slot state pointed at it)
    report STAGED         recorded first (the report survives a restart)
    then                  real disk: ``systemctl reboot`` (``after_stage``);
                            the boot tries the slot (``bootprep`` reads it
                            off the slot and unpacks it into /run, which the
                            reboot emptied) and the boot check keeps it or
                            goes back. An agent that runs after the
                            reboot reads the outcome off the disk's slot state
                            and reports it
                          loopback disk (`LoopbackBoots`): the agent started
                            the new image once for its --help at the write
                            (it unpacks while the old node serves); plays the
                            boots: stops the node, lets `abslots.boot`
                            choose, starts the node from the chosen slot
                            (``node run``), and runs the check: healthy in
                            time -> COMMITTED; else (or the node exits) it
                            "reboots" -> the boot goes back -> ROLLED_BACK

An agent that finds an upgrade begun but not written reports FAILED
("interrupted"), after looking at the disk: a crash after the slot state
was written but before the agent recorded it counts as staged. One that
finds it written waits for the activation again (or stages it, if the
slot state says the activation's write happened). A loopback
upgrade interrupted after staging is played on from the boot: the node is
stopped (if it runs) and booted again, which goes back when the try was
already consumed, as a real boot does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import abslots, blockdev
from .abslots import SlotError, SlotImage
from .daemon import log
from .disks import loopback_disks, valid_name
from .download import DownloadFailed, Source, download
from .errors import AgentError, InstallFailed
from .files import write_atomically
from .generations import MAX_ERROR, Told, read_state
from .install import Settings
from .installplan import image_source
from .loopnode import DISK_STATE, IMAGE, KEY, LOG, PID, ROOT, SLOT_B_IMAGE, node_running
from .wire import (
    UPGRADE_COMMITTED,
    UPGRADE_FAILED,
    UPGRADE_ROLLED_BACK,
    UPGRADE_STAGED,
    UPGRADE_WRITTEN,
    UpgradeReport,
    UpgradeRequest,
)

if TYPE_CHECKING:
    import ssl

#: Bounds on a request's health timeout, seconds.
MIN_HEALTH_TIMEOUT, MAX_HEALTH_TIMEOUT = 5, 24 * 3600
#: Seconds a loopback node is given to stop after SIGTERM before SIGKILL.
STOP_TIMEOUT = 30.0
#: Seconds between looks at a real disk's slot state while a try is under way.
SETTLE_INTERVAL = 2.0
#: The drop-in that tells the node unit where the boot info is (for a unit
#: written before the install set it).
DROP_IN = "metropolis-node.service.d/50-boot-info.conf"

_STATES = {"staged": UPGRADE_STAGED, "committed": UPGRADE_COMMITTED}


class UpgradeFailed(AgentError):
    """An upgrade failed and nothing changed on the machine; the message is the cause."""


def slot_file(disk: str, slot: str) -> str:
    """A loopback disk's file of ``slot``."""
    return os.path.join(disk, IMAGE if slot == "a" else SLOT_B_IMAGE)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# --- a real disk


@dataclasses.dataclass(frozen=True)
class DeviceDisk:
    """An installed block device: its partition nodes and the boot record."""

    device: str
    nodes: list[str]
    header: dict[str, object]
    record_end: int

    @property
    def store(self) -> abslots.DeviceStore:
        return abslots.DeviceStore(self.nodes[0], self.record_end)

    def installed(self) -> abslots.SlotState:
        """The state of a disk with none yet: slot a, as the install wrote it."""
        return abslots.initial(
            SlotImage(str(self.header["image_sha256"]), int(str(self.header["image_bytes"])))
        )

    def state(self) -> abslots.SlotState:
        return self.store.read() or self.installed()


def partition_nodes(device: str) -> list[str]:
    """The /dev nodes of ``device``'s partitions as the kernel knows them now
    (`blockdev.partition_node`): no udev needed, and no re-read of the table.
    (A re-read, ``partx -u``, of a disk whose data partition is mounted may
    give the other partitions new minor numbers; the install's
    `blockdev.partition_nodes` runs on a disk nothing uses.)"""
    name = blockdev.sys_name(os.stat(device).st_rdev)
    return [blockdev.partition_node(part) for part in blockdev.child_partitions(name)]


def open_device(device: str) -> DeviceDisk:
    """The installed disk ``device``; UpgradeFailed unless it is one an install wrote."""
    try:
        nodes = partition_nodes(device)
        header, params = blockdev.read_boot_record(nodes[0]) if nodes else ({}, b"")
    except (OSError, ValueError, blockdev.DeviceFailed) as exc:
        raise UpgradeFailed(f"{device} holds no installed node: {exc}") from exc
    if len(nodes) != 4:
        raise UpgradeFailed(f"{device} has {len(nodes)} partitions, not an installed disk's 4")
    try:
        table = blockdev.read_table(device).get("partitions")
    except (blockdev.DeviceFailed, ValueError, KeyError) as exc:
        raise UpgradeFailed(f"cannot read the partition table of {device}: {exc}") from exc
    names = ("boot", "system_a", "system_b", "data")
    uuids = [str(p.get("uuid", "")).lower() for p in table] if isinstance(table, list) else []
    if uuids != [str(header.get(n, "")) for n in names]:
        raise UpgradeFailed(f"the boot record of {device} does not name its partitions")
    record = len(blockdev.MAGIC) + 16 + len(json.dumps(header, sort_keys=True).encode())
    return DeviceDisk(device, nodes, header, record + len(params))


def write_device(
    disk: DeviceDisk, image: str, digest: str, target: blockdev.Target
) -> tuple[str, int]:
    """Write ``image`` (hex SHA-256 ``digest``) to the inactive slot of ``disk``,
    read it back, and refresh the helpers and the boot check: (the slot, the
    image's size). Nothing points at the slot yet: no boot runs it, so this
    may happen on every machine of a run at once. UpgradeFailed if a try is
    under way, the write fails or reads back wrong."""
    state = disk.state()
    if state.next is not None:
        raise UpgradeFailed(f"a try of slot {state.next} is staged or under way on {disk.device}")
    slot = abslots.other(state.active)
    node = disk.nodes[1] if slot == "a" else disk.nodes[2]
    try:
        abslots.crash_point("upgrade-image")
        size = blockdev.write_image(image, node, digest)
        abslots.crash_point("upgrade-helpers")
        refresh_boot_entry(target, str(disk.header["boot"]))
    except (OSError, blockdev.DeviceFailed, SlotError) as exc:
        raise UpgradeFailed(f"writing slot {slot} of {disk.device}: {exc}") from exc
    return slot, size


def activate_device(
    disk: DeviceDisk, slot: str, digest: str, size: int, health_timeout: float
) -> None:
    """Point the next boot of ``disk`` at ``slot``, once (`abslots.stage`),
    after reading the slot back: it must still hold ``size`` bytes of SHA-256
    ``digest``. UpgradeFailed (nothing pointed at) otherwise, or if a try is
    under way, or the slot is the active one now."""
    state = disk.state()
    if state.next is not None:
        raise UpgradeFailed(f"a try of slot {state.next} is staged or under way on {disk.device}")
    if slot != abslots.other(state.active):
        raise UpgradeFailed(f"slot {slot} of {disk.device} is the active slot now")
    node = disk.nodes[1] if slot == "a" else disk.nodes[2]
    try:
        back = blockdev.sha256_of(node, size)
        if back != digest:
            raise UpgradeFailed(f"slot {slot} of {disk.device} holds SHA-256 {back}, not {digest}")
        abslots.crash_point("upgrade-state")
        disk.store.write(abslots.stage(state, SlotImage(digest, size), health_timeout))
        abslots.crash_point("upgrade-staged")
    except (OSError, blockdev.DeviceFailed, SlotError) as exc:
        raise UpgradeFailed(f"staging slot {slot} of {disk.device}: {exc}") from exc


def stage_device(
    disk: DeviceDisk,
    image: str,
    digest: str,
    health_timeout: float,
    target: blockdev.Target,
) -> str:
    """`write_device`, then `activate_device`: the slot, tried at the next boot.
    Steps and crash points as `abslots` draws them."""
    slot, size = write_device(disk, image, digest, target)
    activate_device(disk, slot, digest, size, health_timeout)
    return slot


def refresh_boot_entry(target: blockdev.Target, boot_partuuid: str) -> None:
    """The helpers and the boot check as this agent has them, and the node
    unit's boot info (a drop-in): what a try needs at boot, whatever agent
    installed the disk. Each file atomic; the check's symlink last."""
    from importlib import resources

    os.makedirs(target.helper_dir, exist_ok=True)
    for name in (*blockdev.HELPER_MODULES, blockdev.HELPER):
        data = resources.files(__package__).joinpath(name).read_bytes()
        abslots.write_file(os.path.join(target.helper_dir, name), data, 0o755)
    helper = os.path.join(target.helper_dir, blockdev.HELPER)
    check = abslots.check_unit(target.python, helper, boot_partuuid)
    abslots.write_file(os.path.join(target.systemd_root, abslots.CHECK_UNIT), check.encode())
    drop_in = os.path.join(target.systemd_root, DROP_IN)
    os.makedirs(os.path.dirname(drop_in), exist_ok=True)
    abslots.write_file(
        drop_in,
        (
            "[Service]\n"
            f"Environment=METROPOLIS_BOOT_INFO={blockdev.RUN}/{abslots.BOOT_INFO} "
            f"METROPOLIS_ANNOUNCE_HEALTHY={blockdev.RUN}/{abslots.HEALTHY}\n"
        ).encode(),
    )
    blockdev.enable(target, abslots.CHECK_UNIT)


def device_outcome(state: abslots.SlotState, digest: str) -> tuple[int, str]:
    """What a real disk's slot state says of the try of ``digest``: (state, detail)."""
    back = state.rolled_back
    if back is not None and back.sha256 == digest:
        return UPGRADE_ROLLED_BACK, f"went back to slot {state.active}: {back.cause}"
    held = state.slots.get(state.active)
    if state.next is None and held is not None and held.sha256 == digest:
        return UPGRADE_COMMITTED, f"slot {state.active} runs {digest[:12]} and is permanent"
    if state.next is not None:
        tried = "booted for its try" if state.trying == state.next else "tried at the next boot"
        return UPGRADE_STAGED, f"slot {state.next} is {tried}"
    return UPGRADE_FAILED, f"the slot state names no slot of {digest[:12]}"


# --- a loopback disk


def write_folder(disk: str, image: str, digest: str) -> tuple[str, int]:
    """`write_device` for a loopback disk: ``image`` (a downloaded file in
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
    """`activate_device` for a loopback disk."""
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
        out = os.open(
            os.path.join(self.disk, LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        )
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.disk,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            os.close(out)
        write_atomically(os.path.join(self.disk, PID), f"{process.pid}\n".encode())
        threading.Thread(target=process.wait, name="node-reaper", daemon=True).start()
        self._process = process

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


# --- the agent's side: which generation, which report


class Upgrader:
    """Which upgrade requests this agent runs, and what it reports (see the module).

    ``after_stage``: what a real disk does once staged: "reboot" (the
    product), or "none" (tests, which boot the disk themselves).
    """

    def __init__(
        self,
        agent_path: str,
        *,
        endpoint_scheme: str,
        ca_certificate: bytes,
        settings: Settings | None = None,
        wake: Callable[[], None] = lambda: None,
        after_stage: str = "reboot",
        stop_timeout: float = STOP_TIMEOUT,
    ) -> None:
        self.agent = os.path.abspath(agent_path)
        self.agent_dir = os.path.dirname(self.agent)
        self.state_file = self.agent + ".upgrade.json"
        self.endpoint_scheme = endpoint_scheme
        self.ca_certificate = ca_certificate
        self.settings = settings or Settings()
        self.wake = wake
        self.after_stage = after_stage
        self.stop_timeout = stop_timeout
        self._lock = threading.Lock()
        self._state: dict[str, Any] | None = None
        self._broken: str | None = None
        self._carried: int | None = None
        self._worker: threading.Thread | None = None
        #: A worker thread runs (the write, or the activation and boots).
        self._busy = False
        #: The request of the current generation said activate.
        self._activate_asked = False
        self._told = Told()
        self._settled_at = 0.0
        self._load()

    # state file

    def _load(self) -> None:
        try:
            state = read_state(self.state_file, ("started", "written", "staged", "done"))
        except (OSError, ValueError) as exc:
            self._broken = f"upgrade state {self.state_file} is unreadable ({exc}); not upgrading"
            log(self._broken)
            return
        if state is None:
            return
        self._state = state
        if state["status"] in ("started", "written") or (
            state["status"] == "staged" and state.get("disk")
        ):
            self._spawn(self._resume)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        """Run ``target`` in the worker thread (the caller holds the lock, or
        nothing else runs yet); `_busy` until it returns."""

        def body() -> None:
            try:
                target(*args)
            finally:
                with self._lock:
                    # Not if a worker of its own took over (a write's worker
                    # ends before the activation asked later starts one).
                    if self._worker is threading.current_thread():
                        self._busy = False

        self._busy = True
        self._worker = threading.Thread(target=body, name="upgrade", daemon=True)
        self._worker.start()

    def _save(self, state: dict[str, Any]) -> None:
        write_atomically(self.state_file, json.dumps(state).encode() + b"\n")
        self._state = state

    def _record(self, **fields: Any) -> None:
        """Save the state with ``fields`` changed, and wake the heartbeat."""
        with self._lock:
            assert self._state is not None
            state = {**self._state, **fields}
            try:
                self._save(state)
            except OSError as exc:
                log(f"generation {state['generation']}: cannot record the upgrade state: {exc}")
                self._state = state
        self.wake()

    def _tell(self, generation: int, message: str) -> None:
        self._told.tell(generation, message)

    @property
    def generation(self) -> int:
        """The last upgrade generation this agent has begun (0: none)."""
        return int(self._state["generation"]) if self._state is not None else 0

    def on_answer(self, request: UpgradeRequest | None) -> None:
        """Take the upgrade request an accepted heartbeat's answer carried: a
        new generation is written (and activated, if the request says so);
        the written generation is activated once a request of it says so."""
        with self._lock:
            self._carried = None if request is None else request.generation
            if request is None or self._broken is not None:
                return
            g = request.generation
            if g <= 0:
                self._tell(g, f"ignoring upgrade of generation {g}: generations start at 1")
                return
            if g < self.generation:
                self._tell(g, f"ignoring upgrade of generation {g}: {self.generation} is newer")
                return
            if g == self.generation:
                assert self._state is not None
                if request.activate and not self._activate_asked:
                    self._activate_asked = True
                    if self._state["status"] == "written" and not self._busy:
                        log(f"upgrade generation {g}: activating the written slot")
                        self._spawn(self._activate)
                return
            if self._busy:
                self._tell(g, f"upgrade of generation {g} waits for the one running now")
                return
            try:
                self._save({"generation": g, "status": "started"})
            except OSError as exc:
                self._broken = f"cannot record upgrade state in {self.state_file}: {exc}"
                log(f"{self._broken}; not upgrading")
                return
            self._activate_asked = request.activate
            log(f"upgrade generation {g}: starting")
            self._spawn(self._run, request)

    def pending_report(self) -> UpgradeReport | None:
        """The report the next heartbeat carries for the generation the server asks for."""
        with self._lock:
            if self._carried is None:
                return None
            if self._broken is not None:
                return UpgradeReport(self._carried, UPGRADE_FAILED, self._broken)
            state = self._state
            if state is None or state["generation"] != self._carried or "report" not in state:
                return None
            settle = (
                state["status"] == "staged"
                and state.get("device")
                and time.monotonic() - self._settled_at >= SETTLE_INTERVAL
            )
        if settle:
            self._settle_device()
        with self._lock:
            assert self._state is not None
            report = self._state["report"]
            return UpgradeReport(
                int(self._state["generation"]),
                int(report["state"]),
                str(report.get("detail", "")),
                str(report.get("slot", "")),
            )

    def busy(self) -> bool:
        """Whether an upgrade's step runs now (it reports when it is done)."""
        with self._lock:
            return self._busy

    def join(self, timeout: float | None = None) -> None:
        """Wait for the running upgrade, if any (tests)."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout)

    # the work

    def _report(self, state: int, detail: str, slot: str = "", *, status: str) -> None:
        report = {"state": state, "detail": detail[:MAX_ERROR], "slot": slot}
        self._record(status=status, report=report)
        g = self.generation
        names = {
            UPGRADE_STAGED: "staged",
            UPGRADE_COMMITTED: "committed",
            UPGRADE_ROLLED_BACK: "rolled back",
            UPGRADE_FAILED: "failed",
            UPGRADE_WRITTEN: "written",
        }
        log(f"upgrade generation {g}: {names.get(state, state)}: {detail}")

    def _plan(self, request: UpgradeRequest) -> tuple[Source, str, float, str, str]:
        """(source, hex digest, health timeout, device, disk folder) of a request."""
        if request.os_image is None:
            raise UpgradeFailed("the request holds no os_image")
        try:
            source, digest = image_source(request.os_image, self.endpoint_scheme)
        except InstallFailed as exc:
            raise UpgradeFailed(str(exc)) from exc
        timeout = request.health_timeout_seconds
        if not MIN_HEALTH_TIMEOUT <= timeout <= MAX_HEALTH_TIMEOUT:
            raise UpgradeFailed(
                f"health timeout {timeout} s is not within {MIN_HEALTH_TIMEOUT} to "
                f"{MAX_HEALTH_TIMEOUT} s"
            )
        name = request.root_device
        disks = loopback_disks(self.agent_dir)
        if name in disks:
            disk = disks[name]
            installed = abslots.read_json(os.path.join(disk, DISK_STATE)) or {}
            if not installed.get("node_public_key") or not os.path.exists(os.path.join(disk, KEY)):
                raise UpgradeFailed(f"loopback disk {name} holds no installed node")
            return source, digest, float(timeout), "", disk
        if not valid_name(name):
            raise UpgradeFailed(f"root device {name!r} is not a device name")
        installed = abslots.read_json(self.agent + ".install.json") or {}
        device = installed.get("device")
        if not isinstance(device, str) or device != blockdev.device_path(name):
            raise UpgradeFailed(
                f"root device {name} is not the device this agent installed "
                f"({device or 'none'}) nor a loopback disk"
            )
        return source, digest, float(timeout), device, ""

    def _context(self) -> ssl.SSLContext:
        import ssl

        return ssl.create_default_context(cadata=self.ca_certificate or None)

    def _run(self, request: UpgradeRequest) -> None:
        """Download and write the new image to the inactive slot
        (WRITTEN); then activate it if asked already."""
        g = request.generation
        try:
            source, digest, timeout, device, disk = self._plan(request)
            self._record(digest=digest, device=device, disk=disk, timeout=timeout)
            context = self._context() if source.scheme == "https" else None
            try:
                tmp = download(
                    source,
                    digest,
                    disk or self.agent_dir,
                    context=context,
                    limits=self.settings.download_limits(),
                    label=f"upgrade generation {g}",
                )
            except DownloadFailed as exc:
                raise UpgradeFailed(str(exc)) from exc
            try:
                if device:
                    # Nothing to unpack ahead here: the boot helper unpacks
                    # the slot into /run, which the reboot empties.
                    slot, size = write_device(
                        open_device(device), tmp, digest, self.settings.target
                    )
                else:
                    slot, size = write_folder(disk, tmp, digest)
                    LoopbackBoots(disk, self.settings.python).prewarm(slot)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            self._record(slot=slot, size=size)
            self._report(
                UPGRADE_WRITTEN,
                f"slot {slot} holds {digest[:12]}, read back; tried once activated",
                slot,
                status="written",
            )
        except UpgradeFailed as exc:
            self._report(UPGRADE_FAILED, str(exc), status="done")
            return
        except Exception as exc:  # an agent bug or a local failure: reported, not fatal
            self._report(UPGRADE_FAILED, f"upgrade failed: {exc!r}", status="done")
            return
        self._activate_if_asked()

    def _activate_if_asked(self) -> None:
        """The written slot: activated now if a request asked so already;
        else the worker is done, and an activation asked from now on starts
        one (`on_answer`): decided under the lock, so none is missed."""
        with self._lock:
            go = self._activate_asked
            if not go:
                self._busy = False
        if go:
            self._activate()

    def _activate(self) -> None:
        """Point the next boot at the written slot (STAGED), then reboot (a
        real disk) or play the boots (a loopback disk)."""
        assert self._state is not None
        state = self._state
        digest, slot = str(state.get("digest", "")), str(state.get("slot", ""))
        device, disk = str(state.get("device") or ""), str(state.get("disk") or "")
        size, timeout = int(state.get("size", 0)), float(state.get("timeout", 0))
        try:
            if device:
                activate_device(open_device(device), slot, digest, size, timeout)
            else:
                activate_folder(disk, slot, digest, size, timeout)
        except UpgradeFailed as exc:
            self._report(UPGRADE_FAILED, str(exc), slot, status="done")
            return
        except Exception as exc:  # an agent bug or a local failure: reported, not fatal
            self._report(UPGRADE_FAILED, f"upgrade failed: {exc!r}", slot, status="done")
            return
        self._report(
            UPGRADE_STAGED, f"slot {slot} holds {digest[:12]}, tried at the next boot", slot,
            status="staged",
        )  # fmt: skip
        self._after_staged()

    def _after_staged(self) -> None:
        assert self._state is not None
        if self._state.get("device"):
            if self.after_stage == "reboot":
                log(f"upgrade generation {self.generation}: rebooting into the new slot")
                subprocess.run(["systemctl", "reboot"], check=False)
            return
        self._play_boots()

    def _play_boots(self) -> None:
        assert self._state is not None
        disk, slot = str(self._state["disk"]), str(self._state.get("slot", ""))
        digest = str(self._state.get("digest", ""))
        try:
            boots = LoopbackBoots(disk, self.settings.python, stop_timeout=self.stop_timeout)
            state, detail = boots.settle(digest)
        except (OSError, SlotError, AgentError) as exc:
            self._report(
                UPGRADE_ROLLED_BACK, f"the boot of the new slot failed: {exc}", slot, status="done"
            )
            return
        self._report(state, detail, slot, status="done")

    def _settle_device(self) -> None:
        """Read a staged real disk's outcome off its slot state."""
        assert self._state is not None
        digest, device = str(self._state.get("digest")), str(self._state.get("device"))
        slot = str(self._state.get("slot", ""))
        self._settled_at = time.monotonic()
        try:
            state, detail = device_outcome(open_device(device).state(), digest)
        except (UpgradeFailed, SlotError, OSError) as exc:
            log(f"upgrade generation {self.generation}: cannot read the slot state: {exc}")
            return
        if state != UPGRADE_STAGED:
            self._report(state, detail, slot, status="done")

    def _pointed_at(self, device: str, disk: str, digest: str) -> bool:
        """Whether the disk's slot state names a try (or its outcome) of
        ``digest``: the activation's state write happened, whatever the agent
        recorded before it stopped (the slot state is written first)."""
        try:
            if device:
                got, _ = device_outcome(open_device(device).state(), digest)
                return got != UPGRADE_FAILED
            if disk:
                stored = abslots.FolderStore(disk).read()
                return stored is not None and device_outcome(stored, digest)[0] != UPGRADE_FAILED
        except (UpgradeFailed, SlotError, OSError) as exc:
            log(f"upgrade generation {self.generation}: cannot read the slot state: {exc}")
        return False

    def _resume(self) -> None:
        """Finish what an earlier run of the agent left."""
        assert self._state is not None
        g, digest = self.generation, str(self._state.get("digest", ""))
        device, disk = str(self._state.get("device") or ""), str(self._state.get("disk") or "")
        if self._state["status"] == "written":
            # Activated after all? The slot state is written before the agent's.
            if not self._pointed_at(device, disk, digest):
                self._activate_if_asked()  # written, not pointed at yet
                return
            self._report(UPGRADE_STAGED, "staged before the agent restarted", status="staged")
        elif self._state["status"] == "started":
            if not self._pointed_at(device, disk, digest):
                if disk:
                    with contextlib.suppress(OSError):
                        # The node may have been stopped by nothing (staging
                        # stops none); a download's leftovers go.
                        for name in os.listdir(disk):
                            if name.startswith(".image-") and name.endswith(".part"):
                                os.unlink(os.path.join(disk, name))
                self._report(
                    UPGRADE_FAILED,
                    "interrupted: the agent stopped before the new slot was staged; this "
                    "generation is not run again",
                    status="done",
                )
                return
            self._report(UPGRADE_STAGED, "staged before the agent restarted", status="staged")
        if disk:
            log(f"upgrade generation {g}: playing the loopback boots on after a restart")
            self._play_boots()
