"""The Shepherd's whole path on nspawn machines for a test module, in a thread.

`shepherd.realfleet.open_real_fleet` runs in a thread's own Trio run (with
trio-asyncio, for SSH) for the whole module, as `fleet_thread.FleetThread`
runs a bare fleet: pytest-trio gives each test a Trio run of its own, and
the machines, the Shepherd and the cluster's first node must outlive them.
The tests reach it the way an operator does: the BMDB (a connection of
their own), the CLIs (``shepherd install``, ``bmdb``, ``metropolis
owner``), SSH to the machines (OpenSSH's client), Redfish to their BMC.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio_asyncio

from shepherd.realfleet import RealFleet, open_real_fleet


@dataclass
class RealThread:
    folder: Path
    bmdb_url: str
    image: Path
    count: int
    disk_size: int | Sequence[int] = 256 << 20
    real: RealFleet | None = None
    error: BaseException | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _token: trio.lowlevel.TrioToken | None = None
    _stop: trio.Event | None = None

    def start(self) -> RealFleet:
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error
        assert self.real is not None
        return self.real

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        try:
            async with (
                trio_asyncio.open_loop(),
                open_real_fleet(
                    self.folder,
                    bmdb_url=self.bmdb_url,
                    count=self.count,
                    image=self.image,
                    disk_size=self.disk_size,
                ) as real,
            ):
                self.real = real
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self.error = exc
        finally:
            self._ready.set()

    def stop(self) -> None:
        """Stop everything (idempotent); raises what stopping raised."""
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

    @property
    def fleet(self) -> RealFleet:
        assert self.real is not None
        return self.real

    def ssh(
        self, index: int, command: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` on machine ``index`` as root (OpenSSH's client)."""
        result = subprocess.run(
            [
                "ssh", "-i", str(self.fleet.ssh_key_file),
                "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
                "-o", "ConnectTimeout=10",
                f"root@{self.fleet.machines.address(index)}", command,
            ],
            capture_output=True, text=True, check=False, timeout=timeout,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(f"{command!r} on machine {index}: {result.stderr}")
        return result

    async def sh(
        self, index: int, command: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """`ssh` from a Trio task (in a worker thread)."""
        return await trio.to_thread.run_sync(self.ssh, index, command, check)

    def wait_ssh(self, index: int, within: float = 120) -> None:
        deadline = time.monotonic() + within
        while True:
            try:
                if self.ssh(index, "true", check=False, timeout=15).returncode == 0:
                    return
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"machine {index}: no SSH within {within} s")
            time.sleep(0.3)

    def install_argv(self, index: int, ticket: str, *more: str) -> list[str]:
        """``python -m shepherd install`` of machine ``index`` onto its disk."""
        real = self.fleet
        return [
            sys.executable, "-m", "shepherd", "install", "--bmdb-url", self.bmdb_url,
            "--machine", str(real.ids[index]),
            "--cluster-info", str(real.cluster_file), "--ticket", ticket,
            "--owner-public-key", str(real.first.owner_key),
            "--image-server", real.images, "--image-digest", f"sha256:{real.image_sha256}",
            "--insecure-plain-http", "--root-device", real.root_device(index), *more,
        ]  # fmt: skip
