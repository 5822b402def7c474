"""Upgrading the installed node to another image, as a heartbeat answer's upgrade request asks.

The A/B machine itself (what is written when, what a crash leaves, what the
next boot does) is `abslots`'s; the steps on a real disk are
`upgradedevice`'s, on a loopback disk `upgradeloop`'s; this module decides
which step runs when, and reports.
`Upgrader` works like `installer.Installer` (`generations`): told each accepted heartbeat's
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
    stage                 real disk (`upgradedevice`): the inactive slot
                            written raw, read back; the helpers and the boot
                            check refreshed; the slot state points at it for
                            the next boot only
                          loopback disk (`upgradeloop`): the inactive slot's
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
                          loopback disk (`upgradeloop.LoopbackBoots`): the agent started
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
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from . import abslots, blockdev
from .abslots import SlotError
from .daemon import log
from .disks import loopback_disks, valid_name
from .download import DownloadFailed, Source, download
from .errors import AgentError, InstallFailed, UpgradeFailed
from .files import remove
from .generations import MAX_ERROR, Generations
from .install import Settings
from .installplan import image_source
from .loopnode import DISK_STATE, KEY, remove_parts
from .upgradedevice import activate_device, device_outcome, open_device, write_device
from .upgradeloop import STOP_TIMEOUT, LoopbackBoots, activate_folder, write_folder
from .wire import (
    UPGRADE_COMMITTED,
    UPGRADE_FAILED,
    UPGRADE_ROLLED_BACK,
    UPGRADE_STAGED,
    UPGRADE_WRITTEN,
    UpgradeReport,
    UpgradeRequest,
)

#: Bounds on a request's health timeout, seconds.
MIN_HEALTH_TIMEOUT, MAX_HEALTH_TIMEOUT = 5, 24 * 3600
#: Seconds between looks at a real disk's slot state while a try is under way.
SETTLE_INTERVAL = 2.0


class Upgrader(Generations):
    """Which upgrade requests this agent runs, and what it reports (see the module).

    ``after_stage``: what a real disk does once staged: "reboot" (the
    product), or "none" (tests, which boot the disk themselves).
    """

    KIND, DOING, REQUEST = "upgrade", "upgrading", "upgrade"
    STATUSES = ("started", "written", "staged", "done")

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
        self.after_stage = after_stage
        self.stop_timeout = stop_timeout
        #: A worker thread runs (the write, or the activation and boots).
        self._busy = False
        #: The request of the current generation said activate.
        self._activate_asked = False
        self._settled_at = 0.0
        super().__init__(
            agent_path,
            endpoint_scheme=endpoint_scheme,
            ca_certificate=ca_certificate,
            settings=settings,
            wake=wake,
        )

    def _loaded(self, state: dict[str, Any]) -> None:
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

    def on_answer(self, request: UpgradeRequest | None) -> None:
        """Take the upgrade request an accepted heartbeat's answer carried: a
        new generation is written (and activated, if the request says so);
        the written generation is activated once a request of it says so."""
        with self._lock:
            g = self._take(None if request is None else request.generation)
            if request is None or g is None:
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
            if not self._begin(g):
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
                remove(tmp)
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
                        remove_parts(disk)
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
