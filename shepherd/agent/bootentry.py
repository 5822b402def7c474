"""The boot entry of a real install: the units that run the node at each
boot, written last, and stopped and removed before the next install or a wipe.

The helper `bootprep` (with `abslots` and `unpack` beside it) and four
units in the systemd root (`units`: the helper's, the data partition's
mount, the node's, and the boot check of `abslots`), then the enable
symlinks (`write_boot_entry`). A cut before it leaves no unit; a cut
inside it leaves unit files without the node's symlink of
``multi-user.target.wants``, which is written last of all.
`stop_installed` undoes it: the node unit stopped, its data unmounted, the
boot entry removed (enable symlink first: `remove_boot_entry`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess

from . import abslots, unpack
from .blockdev import DeviceFailed

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


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the boot entry goes and what the node unit runs."""

    systemd_root: str = "/etc/systemd/system"
    helper_dir: str = "/usr/local/lib/metropolis"
    mount_point: str = "/var/lib/metropolis"
    python: str = "/usr/bin/python3"
    #: Where the node image is unpacked (`unpack.CACHE`).
    cache_dir: str = unpack.CACHE


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
