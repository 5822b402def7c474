"""One install of the node, from a checked request (`installplan.Plan`) to its key.

`install` runs it (in the worker thread of `installer.Installer`, which
records the generation and reports the outcome)::

    download, verify      {scheme}://{host}/images/sha256/{hex} into a
                          temporary file in the disk folder (`download`: TLS
                          verified against the CA from TakeoverInit, bounded,
                          resumed, retried), its SHA-256 checked before
                          anything reaches its final place: a wrong digest
                          removes the temporary file, nothing is left
    write                 image.pyz, node-parameters.pb (the raw bytes),
                          metropolis/ (0700), after removing what an earlier
                          install on this disk left (`loopnode.clear_disk`)
    start the node        detached (`loopnode.start_node`): it outlives the
                          agent, which never signals it
    wait for its key      node.key.pub (32 bytes), bounded; the report is
                          its key, or the node's last log lines

A disk whose node (from an earlier generation) still runs is refused: a
loopback install cannot stop a node without killing what it serves, and a
second node would fight the first for the fixed ports.

A real block device is installed by `realdisk.install_device` (GPT, image
on system A read back, boot record, data partition, the boot entry last),
after the download into a temporary file beside the agent, which is
unpacked meanwhile in a thread of its own into the machine's cache
(`unpack`: the node then starts from files, not from its zip; joined
before the boot entry; a failure left to the boot helper, which unpacks
it itself); a node an earlier install of this agent runs from the disk is
stopped first (its
data partition is not refused as mounted: `bootentry.stop_installed`). Then, as
`Settings.after_install` says: "start" (``systemctl daemon-reload``, start
``metropolis-node.service`` and wait for its key in /run/metropolis),
"reboot" (``systemctl reboot``; the agent that starts after the reboot
reports the key the node announces), or "none" (the report then says the
node was installed but not started, as an error: no key is known). The
``progress`` callback is told "node-started" before the boot entry is
written: from then on a restarted agent waits for the key instead of
calling the generation interrupted.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import blockdev, bootentry, gpt, realdisk, unpack
from .daemon import log
from .download import DownloadFailed, Limits, download
from .errors import InstallFailed
from .files import remove, write_atomically
from .installplan import Plan
from .loopnode import (
    IMAGE,
    PARAMETERS,
    ROOT,
    await_key,
    clear_disk,
    node_running,
    read_key,
    start_node,
    write_disk_state,
)

if TYPE_CHECKING:
    import ssl

#: Where the node unit of a real disk announces its key.
DEVICE_KEY = os.path.join(bootentry.RUN, "node.key.pub")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Bounds of one install (seconds, bytes) and the python that runs the node."""

    max_image_bytes: int = 512 * 1024 * 1024
    #: Bound on connecting and on each read from the image server.
    read_timeout: float = 30.0
    #: Bound on the whole download, retries included: then it gives up.
    download_deadline: float = 900.0
    backoff_start: float = 1.0
    backoff_cap: float = 30.0
    #: Bound on waiting for the started node's key.
    announce_timeout: float = 60.0
    python: str = sys.executable or "python3"
    #: A real block device's partition sizes, and where its boot entry goes.
    layout: gpt.Layout = dataclasses.field(default_factory=gpt.Layout)
    target: bootentry.Target = dataclasses.field(default_factory=bootentry.Target)
    #: After a real install: "start" the node unit, "reboot", or "none".
    after_install: str = "start"

    def download_limits(self) -> Limits:
        return Limits(
            max_bytes=self.max_image_bytes,
            read_timeout=self.read_timeout,
            deadline=self.download_deadline,
            backoff_start=self.backoff_start,
            backoff_cap=self.backoff_cap,
        )


class _Steps:
    """How long each step of one install took, for its log line."""

    def __init__(self) -> None:
        self._steps: list[str] = []
        self._clock = time.monotonic()

    def __call__(self, what: str) -> None:
        now = time.monotonic()
        self._steps.append(f"{what} {now - self._clock:.2f}s")
        self._clock = now

    def __str__(self) -> str:
        return ", ".join(self._steps)


def _download(plan: Plan, context: ssl.SSLContext | None, settings: Settings, step: _Steps) -> str:
    """The image of ``plan``, verified, in a temporary file in ``plan.disk``."""
    try:
        tmp = download(
            plan.source,
            plan.digest,
            plan.disk,
            context=context,
            limits=settings.download_limits(),
            label=f"generation {plan.generation}",
        )
    except DownloadFailed as exc:
        raise InstallFailed(str(exc)) from exc
    step(f"download+verify of {os.path.getsize(tmp)} bytes")
    return tmp


def install(
    plan: Plan,
    context: ssl.SSLContext | None,
    settings: Settings,
    progress: Callable[[str], None],
) -> bytes:
    """Run the install of ``plan``; return the node's public key, or raise
    InstallFailed with the cause. ``progress`` is told "writing" before the
    disk folder is changed and "node-started" before the node is spawned
    (and must have recorded that durably when it returns)."""
    if plan.device:
        return install_device(plan, context, settings, progress)
    running = node_running(plan.disk)
    if running is not None:
        raise InstallFailed(
            f"a node (pid {running}) still runs from {plan.disk}; a loopback install does not "
            "stop it: stop it first"
        )
    step = _Steps()
    tmp = _download(plan, context, settings, step)
    try:
        progress("writing")
        clear_disk(plan.disk, keep=tmp)
        os.replace(tmp, os.path.join(plan.disk, IMAGE))
    except BaseException:
        remove(tmp)
        raise
    write_atomically(os.path.join(plan.disk, PARAMETERS), plan.node_parameters)
    os.mkdir(os.path.join(plan.disk, ROOT), 0o700)
    os.chmod(os.path.join(plan.disk, ROOT), 0o700)  # whatever the umask
    write_disk_state(plan.disk, {"generation": plan.generation, "status": "node-started"})
    step("write")
    progress("node-started")
    alive = start_node(plan, settings.python)
    step("start")
    try:
        return await_key(plan.disk, alive, settings.announce_timeout)
    finally:
        step("announce")
        log(f"generation {plan.generation}: {step}")


def install_device(
    plan: Plan,
    context: ssl.SSLContext | None,
    settings: Settings,
    progress: Callable[[str], None],
) -> bytes:
    """`install` onto a real block device (``plan.device``)."""
    import subprocess

    step = _Steps()
    tmp = _download(plan, context, settings, step)
    key_path = DEVICE_KEY
    # Unpacked while the disk is written, so that the node starts from files
    # as after a warm start (`unpack`); joined before the boot entry.
    unpacking = _Unpacking(tmp, plan.digest, settings.target.cache_dir)
    try:
        progress("writing")
        stopped = bootentry.stop_installed(settings.target)
        if stopped:
            step("stopped the earlier install: " + "; ".join(stopped))
        remove(key_path)  # an earlier node's, if any: the new node announces its own
        try:  # again: an earlier install's data was not refused as mounted
            blockdev.check_device(plan.device, settings.layout)
        except blockdev.DeviceRefused as exc:
            raise InstallFailed(str(exc)) from exc

        def boot_step(what: str) -> None:
            step(what)
            if what == "data":  # the boot entry comes next: its node may start
                waited = unpacking.join()
                step(f"unpack {waited}, waited")
                progress("node-started")

        realdisk.install_device(
            plan.device,
            tmp,
            plan.digest,
            plan.node_parameters,
            plan.node_address,
            layout=settings.layout,
            target=settings.target,
            generation=plan.generation,
            step=boot_step,
        )
    except blockdev.DeviceFailed as exc:
        raise InstallFailed(f"installing onto {plan.device}: {exc}") from exc
    finally:
        unpacking.join()
        remove(tmp)
        log(f"generation {plan.generation}: {step}")
    if settings.after_install == "reboot":
        subprocess.run(["systemctl", "reboot"], check=False)
        return await_device_key(key_path, settings.announce_timeout)
    if settings.after_install != "start":
        raise InstallFailed(
            f"installed onto {plan.device}; the node was not started (after_install "
            f"{settings.after_install!r}): it starts at the next boot"
        )
    for argv in (["systemctl", "daemon-reload"], ["systemctl", "start", bootentry.NODE_UNIT]):
        done = subprocess.run(argv, capture_output=True, check=False, timeout=120)
        if done.returncode != 0:
            raise InstallFailed(
                f"installed onto {plan.device}, but {' '.join(argv)} failed: "
                f"{done.stderr.decode(errors='replace').strip()[-300:]}"
            )
    return await_device_key(key_path, settings.announce_timeout)


class _Unpacking:
    """`unpack.ensure` of a downloaded (verified) image in a thread of its own.

    Its failure does not fail the install: the boot helper unpacks the
    image itself when it finds no folder (a slower first start); why is
    said in the install's log line.
    """

    def __init__(self, image: str, digest: str, cache: str) -> None:
        self._started = time.monotonic()
        self._took = 0.0
        self._error = ""
        self._thread = threading.Thread(
            target=self._run, args=(image, digest, cache), name="unpack", daemon=True
        )
        self._thread.start()

    def _run(self, image: str, digest: str, cache: str) -> None:
        try:
            unpack.ensure(image, digest, cache)
        except (unpack.UnpackError, OSError) as exc:
            self._error = str(exc)[:300]
        self._took = time.monotonic() - self._started

    def join(self) -> str:
        """Wait until done; what happened, for the log line."""
        self._thread.join()
        if self._error:
            return f"failed, the boot helper unpacks it: {self._error}"
        return f"in {self._took:.2f}s"


def await_device_key(path: str, timeout: float) -> bytes:
    """The key the node unit announces at ``path``, waited for at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        key = read_key(path)
        if key is not None:
            return key
        if time.monotonic() > deadline:
            raise InstallFailed(
                f"the node unit did not announce its key within {timeout:g}s "
                f"(journalctl -u {bootentry.NODE_UNIT} says why)"
            )
        time.sleep(0.2)
