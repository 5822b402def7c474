"""Which installation requests this agent runs, and what it reports.

`Installer` is told each accepted heartbeat's installation request
(`Installer.on_answer`) and says what report the next heartbeat carries
(`Installer.pending_report`). A request of a generation greater than the
last one this agent has begun starts one install (`install.install`, its
request checked by `installplan.check_request`) in a worker thread, beside
the heartbeat loop (heartbeats go on during a long download); requests of a
generation already begun are never run again, only answered with the
recorded outcome, sent for as long as the server's answer carries that
generation.

Never twice, across restarts and kills too: the agent-wide state file
``<agent>.install.json`` (beside the agent's key, written atomically:
`generations`) says "generation g started" before the install has any side
effect, "node started" before the node is spawned, and the outcome at the
end. An agent that starts and finds g begun but not finished does not run
it again: if the node had been started, it waits (bounded) for the node's
key as the first agent would have, and reports success or why not; if
not, it reports the error "interrupted" (the generation is done; the
operator asks for a new one). Resuming a half-done download would save
little and is one more path that must never write an unverified image.
On a real disk, "node started" is recorded before the boot entry is
written: from then on a restarted agent waits for the key instead of
calling the generation interrupted.

After a successful install onto a real disk, `Installer.pending_report`
also reports, unasked, what the agent finds of it (`Installer._check`: the
boot record read back off the device at each heartbeat): once after the
agent starts (a reboot: the installed generation is still there), and
whenever that changes (the disk emptied or written over: the generation is
gone, with the cause). The server stores it beside the report
(`Queries.record_installation_check`; the machine shows install-lost).
"""

from __future__ import annotations

import threading
from typing import Any

from . import blockdev, bootrecord
from .daemon import log
from .disks import loopback_disks
from .errors import InstallFailed
from .generations import MAX_ERROR, Generations
from .install import DEVICE_KEY, await_device_key, install
from .installplan import check_request
from .loopnode import DISK_STATE, await_key, node_running, remove_parts, write_disk_state
from .wire import InstallationReport, InstallationRequest


def _report(state: dict[str, Any]) -> InstallationReport:
    generation = int(state["generation"])
    if state.get("node_public_key") is not None:
        key = bytes.fromhex(state["node_public_key"])
        return InstallationReport(generation, node_public_key=key)
    return InstallationReport(generation, error=str(state.get("error") or "unknown outcome"))


class Installer(Generations):
    """Which installation requests this agent runs, and what it reports.

    Called from the heartbeat thread; runs at most one install at a time in
    a worker thread, and calls ``wake`` when an outcome is recorded, so that
    the heartbeat loop reports it without waiting out its interval.
    """

    KIND, DOING, REQUEST = "install", "installing", "request"
    STATUSES = ("started", "node-started", "done")

    #: What the last accepted heartbeat said of the installed generation:
    #: "" installed, else the error; None before any (`_check`).
    _checked: str | None = None

    def _loaded(self, state: dict[str, Any]) -> None:
        if state["status"] != "done":
            self._worker = threading.Thread(target=self._resume, name="install", daemon=True)
            self._worker.start()

    def on_answer(self, request: InstallationRequest | None) -> None:
        """Take the installation request an accepted heartbeat's answer carried."""
        with self._lock:
            g = self._take(None if request is None else request.generation)
            if request is None or g is None or g == self.generation:
                return
            if self._worker is not None and self._worker.is_alive():
                self._tell(g, f"request of generation {g} waits for the install running now")
                return
            # Recorded before any side effect: whatever happens next, g is begun.
            if not self._begin(g):
                return
            log(f"generation {g}: installing")
            self._worker = threading.Thread(
                target=self._run, args=(request,), name="install", daemon=True
            )
            self._worker.start()

    def pending_report(self) -> InstallationReport | None:
        """The report the next heartbeat carries: the outcome of the generation
        the server still asks for, once there is one; when it asks for none,
        what `_check` finds of the generation installed on a real disk."""
        with self._lock:
            state = self._state
            if self._carried is None:
                return None if self._broken is not None else self._check(state)
            if self._broken is not None:
                return InstallationReport(self._carried, error=self._broken)
            if state is None or state["status"] != "done" or state["generation"] != self._carried:
                return None
            return _report(state)

    def _check(self, state: dict[str, Any] | None) -> InstallationReport | None:
        """The installed generation's report, sent unasked when it differs
        from the last one a heartbeat carried: after the agent starts (the
        Shepherd learns it is back and what it finds), and when the disk no
        longer holds the generation (emptied, wiped or written over by
        someone else: an error saying so). Only for a successful install on
        a real disk: its boot record is read back off the device."""
        if state is None or state["status"] != "done" or state.get("node_public_key") is None:
            return None
        device = state.get("device")
        if not isinstance(device, str) or not device:
            return None
        g = int(state["generation"])
        try:
            found = bootrecord.read_installed(device).get("generation")
            if found != g:
                raise blockdev.DeviceFailed(f"its boot record is of generation {found!r}")
            outcome = ""
        except (OSError, blockdev.DeviceFailed) as exc:
            outcome = f"generation {g} is gone from {device}: {exc}"
        if outcome == self._checked:
            return None
        if outcome:
            self._tell(g, outcome)
            return InstallationReport(g, error=outcome[:MAX_ERROR])
        return _report(state)

    def sent(self, report: InstallationReport) -> None:
        """A heartbeat that carried ``report`` was accepted: `_check` sends it
        again only when what it finds differs."""
        with self._lock:
            self._checked = "" if report.node_public_key is not None else (report.error or "")

    def busy(self) -> bool:
        """Whether an install runs now (its outcome is not recorded yet)."""
        worker = self._worker
        return worker is not None and worker.is_alive()

    def _finish(self, generation: int, disk: str | None, *, key: bytes | None, error: str) -> None:
        outcome: dict[str, Any] = {"generation": generation, "status": "done"}
        with self._lock:
            if self._state is not None and self._state.get("device"):
                outcome["device"] = self._state["device"]  # what `wipe` wipes
        if key is not None:
            outcome["node_public_key"] = key.hex()
            log(f"generation {generation}: installed, node key {key.hex()}")
        else:
            outcome["error"] = error[:MAX_ERROR]
            log(f"generation {generation}: install failed: {outcome['error']}")
        if disk is not None:
            try:
                write_disk_state(disk, outcome)
            except OSError as exc:
                log(f"generation {generation}: cannot write {disk}/{DISK_STATE}: {exc}")
        with self._lock:
            try:
                self._save(outcome)
            except OSError as exc:  # reported all the same; a restart reports "interrupted"
                log(f"generation {generation}: cannot record the outcome: {exc}")
                self._state = outcome
        self.wake()

    def _run(self, request: InstallationRequest) -> None:
        g = request.generation
        disk: str | None = None
        try:
            plan = check_request(
                request,
                loopback_disks(self.agent_dir),
                self.endpoint_scheme,
                layout=self.settings.layout,
                work_dir=self.agent_dir,
                target=self.settings.target,
            )
            context = self._context() if plan.scheme == "https" else None

            def progress(status: str) -> None:
                nonlocal disk
                if plan.device:  # no install.json on a block device: the agent's own only
                    # Recorded before the first write, so that a wipe finds the device.
                    status = "started" if status == "writing" else status
                    with self._lock:
                        self._save({"generation": g, "status": status, "device": plan.device})
                    return
                disk = plan.disk
                if status == "node-started":
                    with self._lock:
                        self._save({"generation": g, "status": status, "disk": plan.disk})

            key = install(plan, context, self.settings, progress)
        except InstallFailed as exc:
            self._finish(g, disk, key=None, error=str(exc))
        except Exception as exc:  # an agent bug or a local failure: reported, not fatal
            self._finish(g, disk, key=None, error=f"install failed: {exc!r}")
        else:
            self._finish(g, disk, key=key, error="")

    def _resume(self) -> None:
        """Finish a generation an earlier run of the agent began, without rerunning it."""
        assert self._state is not None
        g = int(self._state["generation"])
        disk = self._state.get("disk")
        device = self._state.get("device")
        if self._state["status"] == "node-started" and isinstance(device, str):
            log(f"generation {g}: installed onto {device} before the agent restarted")
            try:
                key = await_device_key(DEVICE_KEY, self.settings.announce_timeout)
            except InstallFailed as exc:
                self._finish(g, None, key=None, error=f"after an agent restart: {exc}")
            else:
                self._finish(g, None, key=key, error="")
            return
        if self._state["status"] != "node-started" or not isinstance(disk, str):
            # The interrupted download's, if any: into a loopback disk, or
            # beside the agent for a real disk.
            for folder in [*loopback_disks(self.agent_dir).values(), self.agent_dir]:
                remove_parts(folder)
            self._finish(
                g,
                None,
                key=None,
                error="interrupted: the agent stopped during the install, before the node was "
                "started; this generation is not run again",
            )
            return
        log(f"generation {g}: the node was started before the agent restarted; awaiting its key")
        try:
            key = await_key(
                disk, lambda: node_running(disk) is not None, self.settings.announce_timeout
            )
        except InstallFailed as exc:
            self._finish(g, disk, key=None, error=f"after an agent restart: {exc}")
        except Exception as exc:
            self._finish(g, disk, key=None, error=f"after an agent restart: {exc!r}")
        else:
            self._finish(g, disk, key=key, error="")
