"""Installing the node onto a real block device, and wiping one.

What the installer needs of the machine (root, no udev needed):

    commands   sfdisk, partx, blkid, wipefs, blkdiscard (util-linux; Debian
               fdisk + util-linux), mkfs.ext4 (e2fsprogs), python3, systemctl
               (only when the request starts the unit), systemd as PID 1
    paths      /proc/self/mountinfo, /sys/class/block/<dev>/{dev,size,partition},
               /sys/block/<dev>/holders, /dev (nodes made by mknod when missing),
               the systemd root (default /etc/systemd/system) and the helper
               folder (default /usr/local/lib/metropolis), /run/metropolis at boot

Refused before anything is written (`check_device`, the cause is the install
report's): not a block device, a device that holds the running system (it
or a partition of it backs ``/``), a device of which any partition is
mounted (/proc/self/mountinfo, by major:minor) or held (device mapper, RAID),
a device smaller than the layout.

One install (`install_device`), each step a crash point (`crash_point`,
``METROPOLIS_TEST_CRASH_AT`` as in metropolis/crashpoint.py, which the
agent bundle cannot import) and a pause point (`PAUSE_DIR`, where a test
cuts the machine's power), and one more halfway through the image write.
A disk that an earlier install left running is stopped first
(`stop_installed`: its node unit stopped, its data unmounted, its boot
entry removed):

    partition   a GPT written by sfdisk: boot, system A, system B, data, of
                fixed type GUIDs and the sizes of `Layout`; PARTUUIDs read back
                with ``sfdisk --json``; nodes made (`partition_nodes`)
    image       written raw to system A (a fixed-size slot, as Monogon's: an
                A/B upgrade is one write of the other slot, no filesystem to
                repair), then read back from the device and its SHA-256 checked
    boot record on the boot partition, raw and length-prefixed (MAGIC, JSON
                header with the generation, the image's size and digest and
                the PARTUUIDs, the NodeParameters): python3 reads it at boot
                with no extra package; the agent reads its header back at
                each heartbeat (`read_installed`) to tell that the install is
                still there
    data        mkfs.ext4 of the data partition, the node's root
    boot entry  LAST: the helper `bootprep` (with `abslots` and `unpack`
                beside it) and four units in the systemd root (the boot
                check of `abslots` among them), then the enable symlinks. A
                cut before this step leaves no unit; a cut inside it leaves
                unit files without the node's symlink of
                ``multi-user.target.wants``, which is written last of all.

A/B upgrades (slot B written, tried once, kept or given up) are
`abslots`'s and `shepherd.agent.upgrade`'s; the install only writes the
pieces every boot runs.

The wipe (`wipe_device`): see its docstring; each step is reported with
its outcome.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import stat
import struct
import subprocess
from collections.abc import Callable

from . import abslots, unpack
from .errors import AgentError

MIB = 1024 * 1024
CRASH_ENV = "METROPOLIS_TEST_CRASH_AT"

# Fixed partition type GUIDs: the EFI system partition's, and the project's own.
TYPE_BOOT = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
TYPE_SYSTEM = "7E5F4C1A-2B6D-4E1F-9A3C-6D0B5E8F1A21"
TYPE_DATA = "3A9C7B52-1E4D-4F60-8B2A-5C7D9E0F1B34"
NAMES = ("boot", "system-a", "system-b", "data")

#: Tests stop an install at a step (to cut the machine's power there) with
#: a file ``pause-<step>`` here: on the machine's /run, a tmpfs, so a reboot
#: forgets it. The installer then makes ``paused-<step>`` and waits until
#: ``pause-<step>`` is gone. No machine in service has this folder.
PAUSE_DIR = "/run/metropolis-test"

MAGIC = b"MONOTRIO-BOOT1\n"
HELPER = "bootprep.py"
#: Copied beside the helper, which imports them (`abslots`, `unpack`).
HELPER_MODULES = ("abslots.py", "unpack.py")
PREPARE_UNIT = "metropolis-prepare.service"
NODE_UNIT = "metropolis-node.service"
RUN = "/run/metropolis"
#: The unpacked node image the node unit runs (`unpack`), linked by the
#: boot helper at each boot.
NODE_LINK = f"{RUN}/node"
#: The node's root folder under the data partition's mount point.
NODE_ROOT = "metropolis"
_MOUNT_POINT = re.compile(r"(/[A-Za-z0-9_]+)+")


class DeviceRefused(AgentError):
    """A device the installer will not write; the message is the cause."""


class DeviceFailed(AgentError):
    """A step of a real install or wipe failed; the message is the cause."""


def crash_point(step: str) -> None:
    """SIGKILL this process here if ``METROPOLIS_TEST_CRASH_AT`` names ``step``;
    wait here while ``PAUSE_DIR/pause-<step>`` exists (`PAUSE_DIR`)."""
    if os.environ.get(CRASH_ENV) == step:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    pause = os.path.join(PAUSE_DIR, f"pause-{step}")
    if os.path.exists(pause):
        import time

        with open(os.path.join(PAUSE_DIR, f"paused-{step}"), "w"):
            pass
        while os.path.exists(pause):
            time.sleep(0.05)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Partition sizes in MiB (Monogon's by default); data takes the rest."""

    boot_mib: int = 384
    system_mib: int = 4096
    data_min_mib: int = 128

    @property
    def min_bytes(self) -> int:
        # 1 MiB before the first partition and 1 MiB for the backup GPT.
        return (2 + self.boot_mib + 2 * self.system_mib + self.data_min_mib) * MIB


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the boot entry goes and what the node unit runs."""

    systemd_root: str = "/etc/systemd/system"
    helper_dir: str = "/usr/local/lib/metropolis"
    mount_point: str = "/var/lib/metropolis"
    python: str = "/usr/bin/python3"
    #: Where the node image is unpacked (`unpack.CACHE`).
    cache_dir: str = unpack.CACHE


@dataclasses.dataclass(frozen=True)
class Partitions:
    """The four partitions of an installed disk: device nodes and PARTUUIDs."""

    nodes: tuple[str, str, str, str]
    partuuids: tuple[str, str, str, str]


def _run(argv: list[str], stdin: bytes | None = None) -> str:
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, check=False, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DeviceFailed(f"{argv[0]}: {exc}") from exc
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip()[-500:]
        raise DeviceFailed(f"{' '.join(argv)} failed (status {done.returncode}): {err}")
    return done.stdout.decode(errors="replace")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _devno(text: str) -> int:
    major, minor = text.split(":")
    return os.makedev(int(major), int(minor))


def device_path(root_device: str) -> str:
    """The path a request's root_device names: ``/dev/<name>`` or an absolute path."""
    return root_device if root_device.startswith("/") else f"/dev/{root_device}"


def sys_name(devno: int) -> str:
    """The kernel's name of block device ``devno`` (``loop3``), via /sys/dev/block."""
    link = f"/sys/dev/block/{os.major(devno)}:{os.minor(devno)}"
    try:
        return os.path.basename(os.readlink(link))
    except OSError as exc:
        raise DeviceRefused(
            f"block device {os.major(devno)}:{os.minor(devno)} has no {link}"
        ) from exc


def child_partitions(name: str) -> list[str]:
    """The kernel names of ``name``'s partitions, in partition-number order."""
    base = f"/sys/block/{name}"
    found = []
    for child in os.listdir(base):
        if os.path.exists(f"{base}/{child}/partition"):
            found.append((int(_read(f"{base}/{child}/partition")), child))
    return [child for _, child in sorted(found)]


def check_device(root_device: str, layout: Layout, *, own_mount: str | None = None) -> str:
    """The path of the device to install on, or DeviceRefused with the cause.
    ``own_mount``: a mount there is an earlier install's data partition, which
    the install stops first (`stop_installed`), so it is not refused here."""
    path = device_path(root_device)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise DeviceRefused(f"root device {path}: {exc.strerror}") from exc
    if not stat.S_ISBLK(st.st_mode):
        kind = "a character device" if stat.S_ISCHR(st.st_mode) else "not a device"
        raise DeviceRefused(f"root device {path} is not a block device ({kind})")
    name = sys_name(st.st_rdev)
    if os.path.exists(f"/sys/class/block/{name}/partition"):
        raise DeviceRefused(f"root device {path} is a partition, not a whole disk")
    parts = child_partitions(name)
    devnos = {st.st_rdev} | {_devno(_read(f"/sys/class/block/{p}/dev")) for p in parts}
    if os.stat("/").st_dev in devnos:
        raise DeviceRefused(f"root device {path} holds the running system (it backs /)")
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and _devno(fields[2]) in devnos and fields[4] != own_mount:
                raise DeviceRefused(f"root device {path} is mounted: {fields[4]}")
    for held in [name, *parts]:
        holders = os.listdir(f"/sys/class/block/{held}/holders")
        if holders:
            raise DeviceRefused(f"root device {path} is in use by {', '.join(sorted(holders))}")
    size = int(_read(f"/sys/class/block/{name}/size")) * 512
    if size < layout.min_bytes:
        raise DeviceRefused(
            f"root device {path} has {size} bytes, smaller than the layout's {layout.min_bytes}"
        )
    return path


def partition_nodes(device: str) -> list[str]:
    """Make the kernel see ``device``'s partitions (``partx``) and make each
    missing /dev node from /sys/class/block/<part>/dev: no udev needed.

    A node that is there with another device number is one an earlier
    table left (the kernel numbers partitions anew when it reads a table
    again, and without udev nobody updates /dev): it is replaced. A /dev
    entry of that name that is not a block device is refused."""
    name = sys_name(os.stat(device).st_rdev)
    subprocess.run(["partx", "-u", device], capture_output=True, check=False)
    if not child_partitions(name):
        subprocess.run(["partx", "-a", device], capture_output=True, check=False)
    return [partition_node(part) for part in child_partitions(name)]


def partition_node(part: str) -> str:
    """``/dev/<part>``, made from /sys/class/block/<part>/dev, or made again
    (atomically) when it names another device number: a partition table
    written anew gives a loop device's partitions new (dynamic) numbers, and
    a node made for the old table would reach some other partition. A /dev
    entry of that name that is not a block device is refused."""
    node = f"/dev/{part}"
    devno = _devno(_read(f"/sys/class/block/{part}/dev"))
    try:
        found = os.lstat(node)
    except FileNotFoundError:
        os.mknod(node, 0o600 | stat.S_IFBLK, devno)
        return node
    if not stat.S_ISBLK(found.st_mode):
        raise DeviceFailed(f"{node} exists but is not a block device")
    if found.st_rdev != devno:
        fresh = f"{node}.new"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(fresh)
        os.mknod(fresh, 0o600 | stat.S_IFBLK, devno)
        os.replace(fresh, node)
    return node


def read_table(device: str) -> dict[str, object]:
    """``sfdisk --json``'s partition table of ``device``."""
    table = json.loads(_run(["sfdisk", "--json", device]))["partitiontable"]
    assert isinstance(table, dict)
    return table


def partition(device: str, layout: Layout) -> Partitions:
    """Write the GPT, read it back, make the partition nodes."""
    script = (
        "label: gpt\n"
        f"size={layout.boot_mib}MiB, type={TYPE_BOOT}, name={NAMES[0]}\n"
        f"size={layout.system_mib}MiB, type={TYPE_SYSTEM}, name={NAMES[1]}\n"
        f"size={layout.system_mib}MiB, type={TYPE_SYSTEM}, name={NAMES[2]}\n"
        f"type={TYPE_DATA}, name={NAMES[3]}\n"
    )
    _run(["sfdisk", "--quiet", "--wipe", "always", device], script.encode())
    parts = read_table(device).get("partitions")
    want = (TYPE_BOOT, TYPE_SYSTEM, TYPE_SYSTEM, TYPE_DATA)
    if not isinstance(parts, list) or [p.get("type") for p in parts] != list(want):
        raise DeviceFailed(f"the partition table read back from {device} is not the one written")
    nodes = partition_nodes(device)
    if len(nodes) != 4:
        raise DeviceFailed(f"{device}: the kernel shows {len(nodes)} partitions, want 4")
    uuids = [str(p["uuid"]).lower() for p in parts]
    return Partitions(
        (nodes[0], nodes[1], nodes[2], nodes[3]), (uuids[0], uuids[1], uuids[2], uuids[3])
    )


def sha256_of(node: str, size: int) -> str:
    """The SHA-256 of the first ``size`` bytes of ``node``, read with O_DIRECT
    off the device (not from the page cache the write filled)."""
    digest = hashlib.sha256()
    subprocess.run(["blockdev", "--flushbufs", node], capture_output=True, check=False)
    with open(node, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        left = size
        while left:
            chunk = f.read(min(left, MIB))
            if not chunk:
                raise DeviceFailed(f"{node} ends before {size} bytes")
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def write_image(image: str, node: str, digest: str) -> int:
    """Copy file ``image`` raw onto ``node``, fsync, and check the digest read back."""
    size = os.path.getsize(image)
    if size > int(_read(f"/sys/class/block/{os.path.basename(node)}/size")) * 512:
        raise DeviceFailed(f"the image of {size} bytes does not fit {node}")
    with open(image, "rb") as src, open(node, "r+b") as dst:
        written = 0
        while chunk := src.read(MIB):
            dst.write(chunk)
            if written < size // 2 <= written + len(chunk):
                dst.flush()
                os.fsync(dst.fileno())
                crash_point("image-half")  # a test cuts the power here: half an image
            written += len(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    back = sha256_of(node, size)
    if back != digest:
        raise DeviceFailed(f"the image read back from {node} has SHA-256 {back}, want {digest}")
    return size


def write_boot_record(node: str, header: dict[str, object], parameters: bytes) -> None:
    """MAGIC, a length-prefixed JSON header, the length-prefixed NodeParameters."""
    blob = json.dumps(header, sort_keys=True).encode()
    data = (
        MAGIC
        + struct.pack(">Q", len(blob))
        + blob
        + struct.pack(">Q", len(parameters))
        + parameters
    )
    with open(node, "r+b") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_boot_record(node: str) -> tuple[dict[str, object], bytes]:
    """What `write_boot_record` wrote on ``node``, or DeviceFailed."""
    with open(node, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise DeviceFailed(f"{node} holds no boot record")
        (n,) = struct.unpack(">Q", f.read(8))
        header = json.loads(f.read(n))
        (m,) = struct.unpack(">Q", f.read(8))
        return header, f.read(m)


def mount_unit_name(mount_point: str) -> str:
    """systemd's unit name for ``mount_point`` (only [A-Za-z0-9_/] accepted)."""
    if not _MOUNT_POINT.fullmatch(mount_point):
        raise DeviceFailed(f"mount point {mount_point!r} is not /a/b of [A-Za-z0-9_]")
    return mount_point.strip("/").replace("/", "-") + ".mount"


def units(target: Target, boot_partuuid: str, node_address: str) -> dict[str, str]:
    """The unit files of the boot entry, by name.

    The node unit registers the node at its first start (``node register``,
    which makes the node's root) and runs it from its saved state at every
    later one (``node run``: after a reboot, and after a crash that left a
    registration half done, which ``run`` finishes); both announce the
    node's key in /run/metropolis for the agent. ``node_address`` is an IP
    address or host name (`installplan.check_request`), so it needs no quoting.
    """
    mount = mount_unit_name(target.mount_point)
    helper = os.path.join(target.helper_dir, HELPER)
    root = os.path.join(target.mount_point, NODE_ROOT)
    node = f"{target.python} {NODE_LINK} node"
    announce = f"--announce-key {RUN}/node.key.pub"
    register = (
        f"{node} register --parameters {RUN}/node-parameters.pb --root {root} "
        f"--address {node_address} --insecure-seal {announce}"
    )
    start = (
        f"if [ -d {root} ]; then exec {node} run --root {root} {announce}; else exec {register}; fi"
    )
    return {
        PREPARE_UNIT: (
            "[Unit]\nDescription=Metropolis: partition nodes, image and parameters from disk\n"
            "DefaultDependencies=no\n\n"
            "[Service]\nType=oneshot\nRemainAfterExit=yes\n"
            f"ExecStart={target.python} {helper} {boot_partuuid} {target.cache_dir}\n"
        ),
        mount: (
            "[Unit]\nDescription=Metropolis: the node's data partition\n"
            f"Requires={PREPARE_UNIT}\nAfter={PREPARE_UNIT}\n\n"
            # A path outside /dev: systemd then waits for no udev device unit.
            f"[Mount]\nWhat={RUN}/data\nWhere={target.mount_point}\nType=ext4\n"
        ),
        NODE_UNIT: (
            "[Unit]\nDescription=Metropolis node\n"
            f"Requires={mount}\nAfter={mount} network-online.target\n\n"
            "[Service]\nRestart=always\nRestartSec=2\n"
            f"Environment=METROPOLIS_BOOT_INFO={RUN}/{abslots.BOOT_INFO} "
            f"METROPOLIS_ANNOUNCE_HEALTHY={RUN}/{abslots.HEALTHY}\n"
            f"ExecStart=/bin/sh -c '{start}'\n\n"
            "[Install]\nWantedBy=multi-user.target\n"
        ),
        abslots.CHECK_UNIT: abslots.check_unit(target.python, helper, boot_partuuid),
    }


def write_boot_entry(target: Target, boot_partuuid: str, node_address: str) -> list[str]:
    """The helper, the unit files, and last the symlink that enables the node."""
    from importlib import resources

    os.makedirs(target.helper_dir, exist_ok=True)
    for name in HELPER_MODULES:
        module = resources.files(__package__).joinpath(name).read_bytes()
        abslots.write_file(os.path.join(target.helper_dir, name), module)
    helper = resources.files(__package__).joinpath(HELPER).read_bytes()
    abslots.write_file(os.path.join(target.helper_dir, HELPER), helper, 0o755)
    written = []
    for name, text in units(target, boot_partuuid, node_address).items():
        path = os.path.join(target.systemd_root, name)
        abslots.write_file(path, text.encode())
        written.append(path)
    for unit in (abslots.CHECK_UNIT, NODE_UNIT):  # the node's symlink last
        written.append(enable(target, unit))
    return written


def enable(target: Target, unit: str) -> str:
    """The symlink of ``multi-user.target.wants`` that starts ``unit`` at boot."""
    wants = os.path.join(target.systemd_root, "multi-user.target.wants")
    os.makedirs(wants, exist_ok=True)
    link = os.path.join(wants, unit)
    tmp = f"{link}.tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(os.path.join(target.systemd_root, unit), tmp)
    os.replace(tmp, link)
    return link


def remove_boot_entry(target: Target) -> list[str]:
    """Remove the enable symlink first, then the units and the helper."""
    wants = os.path.join(target.systemd_root, "multi-user.target.wants")
    paths = [
        os.path.join(wants, NODE_UNIT),
        os.path.join(wants, abslots.CHECK_UNIT),
        os.path.join(target.systemd_root, NODE_UNIT),
        os.path.join(target.systemd_root, abslots.CHECK_UNIT),
        os.path.join(target.systemd_root, PREPARE_UNIT),
        os.path.join(target.helper_dir, HELPER),
        *(os.path.join(target.helper_dir, name) for name in HELPER_MODULES),
    ]
    with contextlib.suppress(DeviceFailed):  # a bad mount point: no such unit was written
        paths.insert(5, os.path.join(target.systemd_root, mount_unit_name(target.mount_point)))
    removed = []
    for path in paths:
        if os.path.lexists(path):
            os.unlink(path)
            removed.append(path)
    return removed


@dataclasses.dataclass(frozen=True)
class Installed:
    partitions: Partitions
    image_bytes: int
    units: list[str]


def install_device(
    device: str,
    image: str,
    digest: str,
    node_parameters: bytes,
    node_address: str,
    *,
    layout: Layout,
    target: Target,
    generation: int = 0,
    step: Callable[[str], None] = lambda _: None,
) -> Installed:
    """Install onto ``device`` (checked by `check_device`): see the module's steps.
    ``generation`` goes into the boot record (`read_installed` checks it).
    Raises DeviceFailed with the cause; a failure leaves no boot entry."""
    crash_point("partition")
    parts = partition(device, layout)
    step("partition")
    crash_point("image")
    size = write_image(image, parts.nodes[1], digest)
    step(f"image {size} bytes, SHA-256 read back")
    crash_point("boot-record")
    header: dict[str, object] = {
        "generation": generation,
        "image_bytes": size,
        "image_sha256": digest,
        **dict(zip(("boot", "system_a", "system_b", "data"), parts.partuuids, strict=True)),
    }
    write_boot_record(parts.nodes[0], header, node_parameters)
    abslots.DeviceStore(parts.nodes[0]).clear()  # no slot state of an earlier install
    step("boot record")
    crash_point("data")
    _run(["mkfs.ext4", "-q", "-F", "-L", "metropolis-data", "-U", "random", parts.nodes[3]])
    step("data")
    crash_point("boot-entry")
    written = write_boot_entry(target, parts.partuuids[0], node_address)
    step("boot entry")
    return Installed(parts, size, written)


def _systemctl(*args: str) -> str | None:
    """Run ``systemctl ARGS``; None if it worked, else why not. Nothing on a
    machine whose init is not systemd (no /run/systemd/system)."""
    if not os.path.isdir("/run/systemd/system"):
        return "systemd does not run this machine"
    try:
        done = subprocess.run(["systemctl", *args], capture_output=True, check=False, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"systemctl {' '.join(args)}: {exc}"
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip()[-300:]
        return f"systemctl {' '.join(args)} failed (status {done.returncode}): {err}"
    return None


def _unit_inactive(name: str) -> bool:
    """Whether systemd has unit ``name`` inactive (stopped, or failed and gone)."""
    try:
        done = subprocess.run(
            ["systemctl", "is-active", name], capture_output=True, check=False, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.stdout.decode(errors="replace").strip() in ("inactive", "failed")


def unmount(path: str) -> None:
    """Unmount the filesystem at ``path`` with umount(2), not /bin/umount;
    DeviceFailed naming the error (busy, not mounted)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(os.fsencode(path), 0) != 0:
        err = ctypes.get_errno()
        raise DeviceFailed(f"cannot unmount {path}: {os.strerror(err)}")


def _states(names: list[str]) -> str:
    """Each unit's state as systemd has it, e.g. "x.mount: failed/failed (exit-code)"."""
    said = []
    for name in names:
        try:
            done = subprocess.run(
                ["systemctl", "show", "-p", "ActiveState,SubState,Result", name],
                capture_output=True,
                check=False,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            said.append(f"{name}: {exc}")
            continue
        shown = dict(
            line.partition("=")[::2] for line in done.stdout.decode(errors="replace").splitlines()
        )
        said.append(
            f"{name}: {shown.get('ActiveState', '?')}/{shown.get('SubState', '?')}"
            f" ({shown.get('Result', '?')})"
        )
    return "; ".join(said)


def stop_installed(target: Target) -> list[str]:
    """Stop the node an earlier install's boot entry in ``target`` runs and
    unmount its data partition, then remove the boot entry: what a new
    install onto the same disk does first (the new one writes its own).
    The steps done; nothing when there is no boot entry."""
    if not os.path.exists(os.path.join(target.systemd_root, NODE_UNIT)):
        return []
    units_ = [NODE_UNIT, mount_unit_name(target.mount_point), PREPARE_UNIT]
    why = _systemctl("stop", *units_)
    if why is not None and os.path.isdir("/run/systemd/system"):
        # A stop job fails when what it stops is in the middle of something
        # else (the node restarting, its data partition still busy as it
        # goes): kill what is left of the node, forget the failures, and
        # stop once more; a second failure names each unit's state.
        _systemctl("kill", "--signal=SIGKILL", NODE_UNIT)
        _systemctl("reset-failed", *units_)
        why = _systemctl("stop", *units_)
        if why is not None and _unit_inactive(NODE_UNIT) and os.path.ismount(target.mount_point):
            # The node is down but systemd could not run umount for the
            # data partition (seen in nspawn machines on a cgroup v1 host:
            # "Failed to attach to cgroup ... Failed at step CGROUP spawning
            # /bin/umount"): unmount it ourselves, by the system call, and
            # let systemd see the mount gone.
            unmount(target.mount_point)
            _systemctl("reset-failed", *units_)
            why = _systemctl("stop", *units_)
        if why is not None:
            raise DeviceFailed(f"cannot stop the installed node: {why} ({_states(units_)})")
    removed = remove_boot_entry(target)
    _systemctl("daemon-reload")
    return [f"stopped {', '.join(units_)}", *(f"removed {p}" for p in removed)]


def _read_direct(device: str, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` (both multiples of 4096) of ``device``,
    read with O_DIRECT: from the device, never from a page cache that a
    write through another node (a partition, the backing file) left stale."""
    import mmap

    buffer = mmap.mmap(-1, length)  # page-aligned, as O_DIRECT wants
    fd = os.open(device, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:
        got = os.preadv(fd, [buffer], offset)
        return bytes(buffer[:got])
    finally:
        os.close(fd)
        buffer.close()


def read_installed(device: str) -> dict[str, object]:
    """The header of the boot record on ``device``'s first partition, read
    off the device (`_read_direct`); DeviceFailed saying what is missing
    (a disk emptied, wiped or written over since the install)."""
    name = sys_name(os.stat(device).st_rdev)
    parts = child_partitions(name)
    if not parts:
        raise DeviceFailed(f"{device} has no partition")
    start = int(_read(f"/sys/class/block/{parts[0]}/start")) * 512
    data = _read_direct(device, start, 64 * 1024)
    if not data.startswith(MAGIC):
        raise DeviceFailed(f"{device} holds no boot record")
    (n,) = struct.unpack(">Q", data[len(MAGIC) : len(MAGIC) + 8])
    blob = data[len(MAGIC) + 8 : len(MAGIC) + 8 + n]
    try:
        header = json.loads(blob)
    except ValueError as exc:
        raise DeviceFailed(f"the boot record on {device} does not decode: {exc}") from exc
    if len(blob) != n or not isinstance(header, dict):
        raise DeviceFailed(f"the boot record on {device} does not decode")
    return header


# --- the wipe


def _zeroes_at(device: str, offset: int, length: int) -> bool:
    return _read_direct(device, offset, length).count(0) == length


def wipe_device(device: str) -> list[str]:
    """Wipe ``device`` for real; the steps done, each "what: outcome", the
    last one the read-back. DeviceFailed names the step that did not hold.

    Each partition's signatures, then the table's (``wipefs -a``), then the
    whole device: ``blkdiscard``; where the device refuses a discard, or a
    discard leaves its first MiB unzeroed (discard need not zero), a zero-out
    of the whole device (``blkdiscard -z``: the kernel writes zeroes where
    the device has no command for it), so nothing of the node's data stays
    readable. That takes the device's write time; a discard, little."""
    name = sys_name(os.stat(device).st_rdev)
    done = []
    nodes = []
    for part in child_partitions(name):
        node = f"/dev/{part}"
        if not os.path.exists(node):
            devno = _devno(_read(f"/sys/class/block/{part}/dev"))
            os.mknod(node, 0o600 | stat.S_IFBLK, devno)
        nodes.append(node)
    if nodes:  # one wipefs for them all: it fails as a whole, naming the node
        _run(["wipefs", "-a", "-q", *nodes])
        done += [f"wipefs -a {node}: done" for node in nodes]
    _run(["wipefs", "-a", "-q", device])
    done.append(f"wipefs -a {device} (the partition table): done")
    size = int(_read(f"/sys/class/block/{name}/size")) * 512
    discard = subprocess.run(["blkdiscard", "-f", device], capture_output=True, check=False)
    first = min(MIB, size) // 4096 * 4096
    if discard.returncode == 0 and _zeroes_at(device, 0, first):
        done.append(f"blkdiscard {device}: done")
    else:
        why = (
            discard.stderr.decode(errors="replace").strip()[-200:]
            if discard.returncode != 0
            else "the discarded blocks do not read back as zeroes"
        )
        done.append(f"blkdiscard {device}: not enough ({why})")
        _run(["blkdiscard", "-f", "-z", device])
        done.append(f"blkdiscard -z {device} (zeroes over all {size} bytes): done")
    subprocess.run(["partx", "-d", device], capture_output=True, check=False)
    left = _run(["wipefs", "--noheadings", device]).strip()
    if left:
        raise DeviceFailed(f"{device} still shows signatures after the wipe: {left}")
    if child_partitions(name):
        raise DeviceFailed(f"the kernel still shows partitions of {device} after the wipe")
    if not (
        _zeroes_at(device, 0, first) and _zeroes_at(device, size // 4096 * 4096 - first, first)
    ):
        raise DeviceFailed(f"{device} does not read back as zeroes after the wipe")
    done.append(f"read back {device}: no signature, no partition, zeroes at both ends")
    return done
