"""Loopback disks: folders that stand for a machine's disks.

On a loopback machine (`shepherd.localfleet`, tests) a disk is a folder
``<agent dir>/disks/<name>/`` beside the agent (``/root/disks/disk0/`` for
the agent at ``/root/agent``). The hardware report lists each one as a
BlockDevice, told apart from real devices by its model `LOOPBACK_MODEL`,
with its name as serial number: that name is what an installation request
gives as its ``root_device``.

Only plain directories with a plain name count: a symbolic link, a file, or
a name with characters outside ``[A-Za-z0-9._-]`` is no disk, so a name
from a request can never reach outside the ``disks`` folder.
"""

from __future__ import annotations

import os
import re
import stat

#: BlockDevice.vendor and .device_model of a loopback disk (its marker).
LOOPBACK_VENDOR = "monotrio"
LOOPBACK_MODEL = "loopback folder"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def valid_name(name: str) -> bool:
    """Whether ``name`` can name a loopback disk (never ``..``, never a path)."""
    return _NAME.fullmatch(name) is not None and ".." not in name


def loopback_disks(agent_dir: str) -> dict[str, str]:
    """The loopback disks beside an agent in ``agent_dir``: name -> folder path."""
    base = os.path.join(agent_dir, "disks")
    try:
        if not stat.S_ISDIR(os.lstat(base).st_mode):
            return {}
        names = sorted(os.listdir(base))
    except OSError:
        return {}
    disks = {}
    for name in names:
        path = os.path.join(base, name)
        try:
            is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
        except OSError:
            continue
        if is_dir and valid_name(name):
            disks[name] = path
    return disks
