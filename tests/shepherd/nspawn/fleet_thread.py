"""A real nspawn fleet for a whole test module, run in a thread of its own.

pytest-trio gives every test its own Trio run, so an async fixture cannot
outlive one test; booting machines per test would cost a boot each. The
fleet runs in its own thread's Trio run instead, and the tests reach it the
way an operator does: over SSH (OpenSSH's client) and over Redfish (the
product's client, from the test's own Trio run). `stop` ends it and waits.

`skip_unless_possible` skips, in one line saying why, on a host without
root, systemd-nspawn, mmdebstrap or loop devices.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from shepherd.nspawn.fleet import Fleet, open_fleet
from shepherd.ssh_key import SSHKey


def skip_unless_possible() -> None:
    if os.geteuid() != 0:
        pytest.skip("nspawn machines need root")
    for tool in ("systemd-nspawn", "mmdebstrap", "losetup", "ip"):
        if shutil.which(tool) is None:
            pytest.skip(f"nspawn machines need {tool} (Debian: systemd-container mmdebstrap)")
    if not Path("/dev/loop-control").exists():
        pytest.skip("nspawn machines need loop devices (/dev/loop-control)")


@dataclass
class FleetThread:
    folder: Path
    count: int
    disk_size: int = 256 << 20
    key: SSHKey = field(default_factory=SSHKey.generate)
    fleet: Fleet | None = None
    error: BaseException | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _token: trio.lowlevel.TrioToken | None = None
    _stop: trio.Event | None = None

    @property
    def key_file(self) -> Path:
        return self.folder / "id_ed25519"

    def start(self) -> Fleet:
        self.key_file.write_bytes(self.key.openssh_private)
        self.key_file.chmod(0o600)
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error
        assert self.fleet is not None
        return self.fleet

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        try:
            async with open_fleet(
                self.folder,
                count=self.count,
                authorized_keys=[self.key.authorized_key],
                disk_size=self.disk_size,
            ) as fleet:
                self.fleet = fleet
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self.error = exc
        finally:
            self._ready.set()

    def stop(self) -> None:
        """Stop the fleet (idempotent); raises what its stop raised."""
        if self._thread is None:
            return
        if self._token is not None and self._stop is not None:
            stop = self._stop
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(stop.set, trio_token=self._token)
        self._thread.join()
        self._thread = None
        if self.error is not None:
            raise self.error

    def ssh(self, index: int, command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``command`` on machine ``index`` as root with OpenSSH's client."""
        assert self.fleet is not None
        return self.ssh_to(self.fleet.address(index), command, check=check)

    def ssh_to(
        self, address: str, command: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                "ssh",
                "-i",
                str(self.key_file),
                "-o",
                "BatchMode=yes",
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "LogLevel=ERROR",
                "-o",
                "ConnectTimeout=10",
                f"root@{address}",
                command,
            ],
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )
