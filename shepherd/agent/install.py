"""Installing the node, as a heartbeat answer's installation request asks.

`Installer` is told each accepted heartbeat's installation request
(`Installer.on_answer`) and says what report the next heartbeat carries
(`Installer.pending_report`). A request of a generation greater than the
last one this agent has begun starts one install in a worker thread, beside
the heartbeat loop (heartbeats go on during a long download); requests of a
generation already begun are never run again, only answered with the
recorded outcome, sent for as long as the server's answer carries that
generation.

Never twice, across restarts and kills too: the agent-wide state file
``<agent>.install.json`` (beside the agent's key, written atomically) says
"generation g started" before the install has any side effect, "node
started" before the node is spawned, and the outcome at the end. An agent
that starts and finds g begun but not finished does not run it again: if
the node had been started, it waits (bounded) for the node's key as the
first agent would have, and reports success or why not; if not, it reports
the error "interrupted" (the generation is done; the operator asks for a
new one). Resuming a half-done download would save little and is one more
path that must never write an unverified image.

One install, in order (`install`)::

    check the request     root_device one of the loopback disks (`disks`), or
                          a real disk as the hardware report names it (its
                          serial number, or its kernel name without one:
                          `disks.real_disks`; else a node /dev/<name>) that
                          `blockdev.check_device` accepts; bounds and shapes
                          a request must keep
    download, verify      {scheme}://{host}/images/sha256/{hex} into a
                          temporary file in the disk folder (`download`: TLS
                          verified against the CA from TakeoverInit, bounded,
                          resumed, retried), its SHA-256 checked before
                          anything reaches its final place: a wrong digest
                          removes the temporary file, nothing is left
    write                 image.pyz, node-parameters.pb (the raw bytes),
                          metropolis/ (0700), after removing what an earlier
                          install on this disk left
    start the node        detached (own session, stdin /dev/null, output to
                          node.log, pid in node.pid): it outlives the agent,
                          which never signals it
    wait for its key      node.key.pub (32 bytes), bounded; the report is
                          its key, or the node's last log lines

A disk whose node (from an earlier generation) still runs is refused: a
loopback install cannot stop a node without killing what it serves, and a
second node would fight the first for the fixed ports.

A real block device is installed by `blockdev.install_device` (GPT, image
on system A read back, boot record, data partition, the boot entry last),
after the download into a temporary file beside the agent, which is
unpacked meanwhile in a thread of its own into the machine's cache
(`unpack`: the node then starts from files, not from its zip; joined
before the boot entry; a failure left to the boot helper, which unpacks
it itself); a node an earlier install of this agent runs from the disk is
stopped first (its
data partition is not refused as mounted: `blockdev.stop_installed`). Then, as
`Settings.after_install` says: "start" (``systemctl daemon-reload``, start
``metropolis-node.service`` and wait for its key in /run/metropolis),
"reboot" (``systemctl reboot``; the agent that starts after the reboot
reports the key the node announces), or "none" (the report then says the
node was installed but not started, as an error: no key is known). "node
started" is recorded before the boot entry is written: from then on a
restarted agent waits for the key instead of calling the generation
interrupted.

After a successful install onto a real disk, `Installer.pending_report`
also reports, unasked, what the agent finds of it (`Installer._check`: the
boot record read back off the device at each heartbeat): once after the
agent starts (a reboot: the installed generation is still there), and
whenever that changes (the disk emptied or written over: the generation is
gone, with the cause). The server stores it beside the report
(`Queries.record_installation_check`; the machine shows install-lost).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import blockdev, unpack
from .daemon import log
from .disks import loopback_disks, real_disks, resolve_real, valid_name
from .download import PART_PREFIX, PART_SUFFIX, DownloadFailed, Limits, Source, download
from .errors import AgentError
from .wire import InstallationReport, InstallationRequest, OSImageRef

if TYPE_CHECKING:
    import ssl

#: Bound on the raw NodeParameters a request may carry.
MAX_NODE_PARAMETERS = 1024 * 1024
#: Bound on an error cause the agent reports.
MAX_ERROR = 4000
#: Messages about refused requests the installer remembers having logged
#: (`Installer._tell`), so as not to log them at every heartbeat.
TOLD_MAX = 64
BLOCK_DEVICE_REFUSAL = (
    "installing onto a block device is not implemented: a real install would partition, "
    "write the image, add a boot entry and reboot"
)

# What an install writes on the disk folder, and what it removes there first.
IMAGE, PARAMETERS, ROOT = "image.pyz", "node-parameters.pb", "metropolis"
PID, LOG, KEY, DISK_STATE = "node.pid", "node.log", "node.key.pub", "install.json"
#: What an upgrade adds there (`upgrade`, `abslots`): slot B's image, the
#: slot state, and the boot's and the node's run-time files. Removed too.
SLOT_B_IMAGE = "image-b.pyz"
UPGRADE_FILES = (SLOT_B_IMAGE, "slots.json", "boot.json", "healthy.json")

_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_HOST = re.compile(r"(?:\[([0-9A-Fa-f:.]+)\]|([A-Za-z0-9.-]+))(?::([0-9]{1,5}))?")
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


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
    layout: blockdev.Layout = dataclasses.field(default_factory=blockdev.Layout)
    target: blockdev.Target = dataclasses.field(default_factory=blockdev.Target)
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


class InstallFailed(AgentError):
    """An install failed; the message is the cause the report carries."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked request: what to download from where, and where to put it."""

    generation: int
    disk: str
    scheme: str
    host: str
    port: int
    path: str
    digest: str  # 64 lowercase hex
    node_parameters: bytes
    node_address: str
    #: A real block device's path ("" for a loopback disk); ``disk`` is then
    #: the folder the download's temporary file goes to.
    device: str = ""

    @property
    def source(self) -> Source:
        return Source(self.scheme, self.host, self.port, self.path)


def _valid_host_name(name: str) -> bool:
    labels = name.rstrip(".").split(".") if len(name) <= 253 else []
    return (
        bool(labels)
        and all(_LABEL.fullmatch(label) for label in labels)
        and not (
            labels[-1].isdigit()  # 1.2.3.999 is a bad address, not a name
        )
    )


def _valid_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return _valid_host_name(text)
    return True


def _has_boot_entry(target: blockdev.Target) -> bool:
    return os.path.exists(os.path.join(target.systemd_root, blockdev.NODE_UNIT))


def real_device_name(name: str, loopback: dict[str, str]) -> str:
    """The kernel name of the device a request's ``root_device`` names, when
    it is no loopback disk: the real disk the hardware report names so
    (`disks.real_disks`), else a node ``/dev/<name>`` (which
    `blockdev.check_device` then judges: a character device, a partition,
    a RAM disk are refused there). InstallFailed if it names nothing."""
    real = real_disks()
    try:
        found = resolve_real(name, real)
    except ValueError as exc:
        raise InstallFailed(str(exc)) from exc
    if found is not None:
        return found
    if valid_name(name) and os.path.lexists(f"/dev/{name}"):
        return name
    listed = ", ".join(loopback) or "none"
    named = ", ".join(d.name for d in real) or "none"
    raise InstallFailed(
        f"root device {name!r} is not one of this machine's loopback disks ({listed}) "
        f"nor of its real disks ({named})"
    )


def check_request(
    request: InstallationRequest,
    disks: dict[str, str],
    endpoint_scheme: str,
    layout: blockdev.Layout | None = None,
    work_dir: str = "",
    target: blockdev.Target | None = None,
) -> Plan:
    """The plan of a request, or InstallFailed with the cause it is refused for.
    ``target``: where this agent's installs put their boot entry; a device
    one of them runs from (its data mounted there) is not refused as
    mounted, since the install stops that node first."""
    m = request.metropolis
    if m is None:
        raise InstallFailed("the request holds no Metropolis installation")
    if m.node_parameters is None:
        raise InstallFailed("the request holds no node_parameters")
    if len(m.node_parameters) > MAX_NODE_PARAMETERS:
        raise InstallFailed(
            f"node_parameters of {len(m.node_parameters)} bytes, over the bound of "
            f"{MAX_NODE_PARAMETERS}"
        )
    name = m.root_device
    device = ""
    if name not in disks:
        kernel_name = real_device_name(name, disks)
        if layout is None:
            raise InstallFailed(f"root device {name}: {BLOCK_DEVICE_REFUSAL}")
        own = target.mount_point if target is not None and _has_boot_entry(target) else None
        try:
            device = blockdev.check_device(kernel_name, layout, own_mount=own)
        except blockdev.DeviceRefused as exc:
            raise InstallFailed(str(exc)) from exc
    if not _valid_address(m.node_address):
        raise InstallFailed(f"node_address {m.node_address!r} is not an IP address or host name")
    image = m.os_image
    if image is None:
        raise InstallFailed("the request holds no os_image")
    source, digest = image_source(image, endpoint_scheme)
    return Plan(
        generation=request.generation,
        disk=work_dir if device else disks[m.root_device],
        scheme=source.scheme,
        host=source.host,
        port=source.port,
        path=source.path,
        digest=digest,
        node_parameters=m.node_parameters,
        node_address=m.node_address,
        device=device,
    )


def image_source(image: OSImageRef, endpoint_scheme: str) -> tuple[Source, str]:
    """Where an OSImageRef's image is downloaded from, and its hex SHA-256;
    InstallFailed with the cause a request is refused for."""
    digest = _DIGEST.fullmatch(image.digest)
    if digest is None:
        raise InstallFailed(f"image digest {image.digest!r} is not sha256:<64 lowercase hex>")
    if image.scheme not in ("http", "https"):
        raise InstallFailed(f"image scheme {image.scheme!r} is neither https nor http")
    if image.scheme == "http" and endpoint_scheme != "http":
        raise InstallFailed("a plain http image is refused: the agent's endpoint uses https")
    host = _HOST.fullmatch(image.host)
    if host is None:
        raise InstallFailed(f"image host {image.host!r} is not HOST[:PORT]")
    v6, name_or_v4, port_text = host.groups()
    port = int(port_text) if port_text else (443 if image.scheme == "https" else 80)
    if v6 is not None:
        try:
            ipaddress.IPv6Address(v6)
        except ValueError:
            raise InstallFailed(f"image host {image.host!r} is not HOST[:PORT]") from None
    elif not _valid_address(name_or_v4):
        raise InstallFailed(f"image host {image.host!r} is not HOST[:PORT]")
    if not 0 < port < 65536:
        raise InstallFailed(f"image host {image.host!r}: port out of range")
    source = Source(
        image.scheme,
        v6 if v6 is not None else name_or_v4,
        port,
        f"/images/sha256/{digest.group(1)}",
    )
    return source, digest.group(1)


# --- files


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Told:
    """Messages logged once per generation (heartbeats repeat requests).

    Remembers the last `TOLD_MAX` messages only: a server that asks for one
    refused generation after another (each a new entry) cannot grow the
    agent's memory; a message forgotten is logged again if asked again,
    which a server repeating that many refusals has earned.
    """

    def __init__(self) -> None:
        # A dict as an ordered set, oldest first.
        self._seen: dict[tuple[int, str], None] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def tell(self, generation: int, message: str) -> None:
        key = (generation, message)
        if key in self._seen:
            return
        self._seen[key] = None
        if len(self._seen) > TOLD_MAX:
            del self._seen[next(iter(self._seen))]
        log(message)


def read_state(path: str, statuses: tuple[str, ...]) -> dict[str, Any] | None:
    """The JSON state file at ``path`` (an install's or an upgrade's), or None
    if there is none; ValueError or OSError if it cannot be read, has no
    generation, or a status not among ``statuses``."""
    try:
        with open(path, "rb") as f:
            state = json.loads(f.read(64 * 1024))
    except FileNotFoundError:
        return None
    if not isinstance(state, dict) or not isinstance(state.get("generation"), int):
        raise ValueError("no generation in it")
    if state.get("status") not in statuses:
        raise ValueError(f"unknown status {state.get('status')!r}")
    return state


def write_atomically(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``path`` so that a reader sees the old or the new content, never half."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _clear_disk(disk: str, *, keep: str) -> None:
    """Remove what an earlier install (or an interrupted download) left, but ``keep``."""
    import shutil

    for name in (IMAGE, PARAMETERS, PID, LOG, KEY, DISK_STATE, *UPGRADE_FILES):
        _remove(os.path.join(disk, name))
    root = os.path.join(disk, ROOT)
    if os.path.lexists(root):
        if os.path.islink(root) or not os.path.isdir(root):
            _remove(root)
        else:
            shutil.rmtree(root)
    _remove_parts(disk, keep=keep)


def _remove_parts(disk: str, *, keep: str = "") -> None:
    """Remove the temporary files of downloads into ``disk`` (but ``keep``)."""
    for name in os.listdir(disk):
        path = os.path.join(disk, name)
        if name.startswith(PART_PREFIX) and name.endswith(PART_SUFFIX) and path != keep:
            _remove(path)


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


def _read_key(path: str) -> bytes | None:
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
        key = _read_key(path)
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
    import subprocess

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
    return lambda: process.returncode is None and node_running(disk) is not None


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
    steps: list[str] = []
    clock = time.monotonic()

    def step(what: str) -> None:
        nonlocal clock
        now = time.monotonic()
        steps.append(f"{what} {now - clock:.2f}s")
        clock = now

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
    try:
        progress("writing")
        _clear_disk(plan.disk, keep=tmp)
        os.replace(tmp, os.path.join(plan.disk, IMAGE))
    except BaseException:
        _remove(tmp)
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
        log(f"generation {plan.generation}: " + ", ".join(steps))


def install_device(
    plan: Plan,
    context: ssl.SSLContext | None,
    settings: Settings,
    progress: Callable[[str], None],
) -> bytes:
    """`install` onto a real block device (``plan.device``)."""
    import subprocess

    steps: list[str] = []
    clock = time.monotonic()

    def step(what: str) -> None:
        nonlocal clock
        now = time.monotonic()
        steps.append(f"{what} {now - clock:.2f}s")
        clock = now

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
    key_path = os.path.join(blockdev.RUN, "node.key.pub")
    # Unpacked while the disk is written, so that the node starts from files
    # as after a warm start (`unpack`); joined before the boot entry.
    unpacking = _Unpacking(tmp, plan.digest, settings.target.cache_dir)
    try:
        progress("writing")
        stopped = blockdev.stop_installed(settings.target)
        if stopped:
            step("stopped the earlier install: " + "; ".join(stopped))
        _remove(key_path)  # an earlier node's, if any: the new node announces its own
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

        blockdev.install_device(
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
        _remove(tmp)
        log(f"generation {plan.generation}: " + ", ".join(steps))
    if settings.after_install == "reboot":
        subprocess.run(["systemctl", "reboot"], check=False)
        return await_device_key(key_path, settings.announce_timeout)
    if settings.after_install != "start":
        raise InstallFailed(
            f"installed onto {plan.device}; the node was not started (after_install "
            f"{settings.after_install!r}): it starts at the next boot"
        )
    for argv in (["systemctl", "daemon-reload"], ["systemctl", "start", blockdev.NODE_UNIT]):
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
        key = _read_key(path)
        if key is not None:
            return key
        if time.monotonic() > deadline:
            raise InstallFailed(
                f"the node unit did not announce its key within {timeout:g}s "
                f"(journalctl -u {blockdev.NODE_UNIT} says why)"
            )
        time.sleep(0.2)


def write_disk_state(disk: str, state: dict[str, object]) -> None:
    """The disk's own ``install.json``: which generation installed what on it."""
    write_atomically(os.path.join(disk, DISK_STATE), json.dumps(state).encode() + b"\n")


# --- the agent's side: which generation, which report


def _report(state: dict[str, Any]) -> InstallationReport:
    generation = int(state["generation"])
    if state.get("node_public_key") is not None:
        key = bytes.fromhex(state["node_public_key"])
        return InstallationReport(generation, node_public_key=key)
    return InstallationReport(generation, error=str(state.get("error") or "unknown outcome"))


class Installer:
    """Which installation requests this agent runs, and what it reports.

    Called from the heartbeat thread; runs at most one install at a time in
    a worker thread, and calls ``wake`` when an outcome is recorded, so that
    the heartbeat loop reports it without waiting out its interval.
    """

    def __init__(
        self,
        agent_path: str,
        *,
        endpoint_scheme: str,
        ca_certificate: bytes,
        settings: Settings | None = None,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.agent_dir = os.path.dirname(os.path.abspath(agent_path))
        self.state_file = os.path.abspath(agent_path) + ".install.json"
        self.endpoint_scheme = endpoint_scheme
        self.ca_certificate = ca_certificate
        self.settings = settings or Settings()
        self.wake = wake
        self._lock = threading.Lock()
        self._state: dict[str, Any] | None = None
        #: Why the state file cannot be trusted; every request is then refused.
        self._broken: str | None = None
        #: The generation the server's last answer carried.
        self._carried: int | None = None
        self._worker: threading.Thread | None = None
        self._told = Told()
        #: What the last accepted heartbeat said of the installed generation:
        #: "" installed, else the error; None before any (`_check`).
        self._checked: str | None = None
        self._load()

    def _load(self) -> None:
        try:
            state = read_state(self.state_file, ("started", "node-started", "done"))
        except (OSError, ValueError) as exc:
            self._broken = f"install state {self.state_file} is unreadable ({exc}); not installing"
            log(self._broken)
            return
        if state is None:
            return
        self._state = state
        if state["status"] != "done":
            self._worker = threading.Thread(target=self._resume, name="install", daemon=True)
            self._worker.start()

    def _save(self, state: dict[str, Any]) -> None:
        write_atomically(self.state_file, json.dumps(state).encode() + b"\n")
        self._state = state

    def _tell(self, generation: int, message: str) -> None:
        self._told.tell(generation, message)

    @property
    def generation(self) -> int:
        """The last generation this agent has begun (0: none)."""
        return int(self._state["generation"]) if self._state is not None else 0

    def on_answer(self, request: InstallationRequest | None) -> None:
        """Take the installation request an accepted heartbeat's answer carried."""
        with self._lock:
            self._carried = None if request is None else request.generation
            if request is None or self._broken is not None:
                return
            g = request.generation
            if g <= 0:
                self._tell(g, f"ignoring request of generation {g}: generations start at 1")
                return
            if g <= self.generation:
                if g < self.generation:
                    self._tell(g, f"ignoring request of generation {g}: {self.generation} is newer")
                return
            if self._worker is not None and self._worker.is_alive():
                self._tell(g, f"request of generation {g} waits for the install running now")
                return
            # Recorded before any side effect: whatever happens next, g is begun.
            try:
                self._save({"generation": g, "status": "started"})
            except OSError as exc:
                # Unrecorded, a generation could run twice: none runs.
                self._broken = f"cannot record install state in {self.state_file}: {exc}"
                log(f"{self._broken}; not installing")
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
            found = blockdev.read_installed(device).get("generation")
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

    def join(self, timeout: float | None = None) -> None:
        """Wait for the running install, if any (tests)."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout)

    def _context(self) -> ssl.SSLContext:
        import ssl

        return ssl.create_default_context(cadata=self.ca_certificate or None)

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
                key = await_device_key(
                    os.path.join(blockdev.RUN, "node.key.pub"), self.settings.announce_timeout
                )
            except InstallFailed as exc:
                self._finish(g, None, key=None, error=f"after an agent restart: {exc}")
            else:
                self._finish(g, None, key=key, error="")
            return
        if self._state["status"] != "node-started" or not isinstance(disk, str):
            # The interrupted download's, if any: into a loopback disk, or
            # beside the agent for a real disk.
            for folder in [*loopback_disks(self.agent_dir).values(), self.agent_dir]:
                _remove_parts(folder)
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
