"""What this node runs: its image, the disk slot it was booted from, whether the boot is a try.

The node reports it in every status push (``NodeStatus.image``), so that
the cluster itself (``owner nodes``, the console, the Shepherd's upgrade
gate) says which image each node runs, not the machine's agent. Two
sources, both optional:

    the image       ``METROPOLIS_IMAGE``: the node image this process runs
                    from (:mod:`metropolis.image.entry` sets it to
                    ``sys.argv[0]``). A zipapp file: its SHA-256, computed
                    once from the file itself: the image's digest is its
                    name, and what the node reports is what it runs,
                    whatever anybody says. A folder (the image unpacked into
                    files, ``shepherd/agent/unpack.py``; an installed node
                    runs from /run/metropolis/node, a link to it): the name
                    of the folder the path resolves to, which is the SHA-256
                    of the image it was unpacked from (checked before it was
                    unpacked; hashing the files would say nothing more).
                    Absent (a node run from source): no digest.
    the boot info   ``--boot-info FILE`` (or ``METROPOLIS_BOOT_INFO``), the
                    JSON the boot wrote: ``bootprep`` on a real disk, the
                    agent on a loopback disk (``shepherd/agent/abslots.py``
                    writes both)::

                        {"slot": "a" | "b", "image_sha256": "<64 hex>",
                         "trial": true | false,
                         "rolled_back_sha256": "<64 hex>" | "",
                         "rollback_cause": "<one line>" | ""}

                    Read again at every push: a try confirmed healthy is
                    rewritten with ``"trial": false``, and the node then
                    reports the slot as permanent. Absent: slot NONE.

A boot info file that does not parse is reported as slot NONE and logged
(once per content), never raised: what a node runs is information, and a
damaged file must not stop the node's heartbeat. A boot info that names
another image than the file the node runs from is logged too; the image's
own digest is reported.

Blocking reads (small files, a hash once): callers use a thread
(:meth:`RunningImageSource.read` does).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import trio

from metropolis.errors import MetropolisError
from metropolis.proto.common import NodeStatusRunningImage, NodeStatusRunningImageSlot

__all__ = [
    "BOOT_INFO_ENV",
    "IMAGE_ENV",
    "MAX_BOOT_INFO",
    "BootInfo",
    "BootInfoError",
    "RunningImageSource",
    "parse_boot_info",
]

_log = logging.getLogger("metropolis.roleserve.bootinfo")

#: The node image file this process runs from (set by the image's entry point).
IMAGE_ENV = "METROPOLIS_IMAGE"
#: The default of ``--boot-info`` (what the installed node unit sets).
BOOT_INFO_ENV = "METROPOLIS_BOOT_INFO"
#: The default of ``--announce-healthy``.
ANNOUNCE_HEALTHY_ENV = "METROPOLIS_ANNOUNCE_HEALTHY"
#: Largest boot info file read, bytes.
MAX_BOOT_INFO = 16 * 1024
#: Longest rollback cause reported, characters.
MAX_CAUSE = 500

_HEX64 = re.compile(r"[0-9a-f]{64}")
_SLOTS = {"a": NodeStatusRunningImageSlot.A, "b": NodeStatusRunningImageSlot.B}


class BootInfoError(MetropolisError):
    """A boot info file that is not what the boot writes; the message says why."""


@dataclass(frozen=True)
class BootInfo:
    """A checked boot info file."""

    slot: str
    image_sha256: str
    trial: bool
    rolled_back_sha256: str = ""
    rollback_cause: str = ""


def parse_boot_info(data: bytes) -> BootInfo:
    """The boot info in ``data``; `BootInfoError` unless it is exactly what the boot writes."""
    if len(data) > MAX_BOOT_INFO:
        raise BootInfoError(f"{len(data)} bytes, over the bound of {MAX_BOOT_INFO}")
    try:
        fields = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise BootInfoError(f"not JSON: {e}") from None
    if not isinstance(fields, dict):
        raise BootInfoError("not a JSON object")
    slot = fields.get("slot")
    if slot not in _SLOTS:
        raise BootInfoError(f"slot {slot!r} is neither 'a' nor 'b'")
    image = fields.get("image_sha256")
    if not isinstance(image, str) or not _HEX64.fullmatch(image):
        raise BootInfoError("image_sha256 is not 64 lowercase hex digits")
    trial = fields.get("trial")
    if not isinstance(trial, bool):
        raise BootInfoError("trial is not true or false")
    rolled_back = fields.get("rolled_back_sha256", "")
    if not isinstance(rolled_back, str) or (rolled_back and not _HEX64.fullmatch(rolled_back)):
        raise BootInfoError("rolled_back_sha256 is neither empty nor 64 lowercase hex digits")
    cause = fields.get("rollback_cause", "")
    if not isinstance(cause, str):
        raise BootInfoError("rollback_cause is not a string")
    cause = "".join(c if c.isprintable() else "?" for c in cause)[:MAX_CAUSE]
    return BootInfo(str(slot), image, trial, rolled_back, cause)


def _image_sha256(path: str) -> str:
    """The SHA-256 of the image at ``path``, a zipapp or its unpacked folder
    (see the module); OSError if it cannot be told."""
    if os.path.isdir(path):
        name = os.path.basename(os.path.realpath(path))
        if not _HEX64.fullmatch(name):
            raise OSError(errno.EINVAL, "a folder not named by an image's SHA-256")
        return name
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class RunningImageSource:
    """What this node runs, as a status push reports it (see the module).

    ``image``: the image file (default: ``METROPOLIS_IMAGE``, None: from
    source); ``boot_info``: the boot info file, if any.
    """

    def __init__(self, boot_info: Path | None, image: str | None = None) -> None:
        self.boot_info = boot_info
        self.image = image if image is not None else os.environ.get(IMAGE_ENV) or None
        self._digest: str | None = None
        self._told: set[str] = set()

    def _tell(self, message: str) -> None:
        if message not in self._told:
            self._told.add(message)
            _log.warning("%s", message)

    def read_sync(self) -> NodeStatusRunningImage:
        """The running image now (blocking: a hash at the first call, a small read)."""
        if self._digest is None and self.image is not None:
            try:
                self._digest = _image_sha256(self.image)
            except OSError as e:
                self._tell(f"cannot read the node image {self.image}: {e.strerror or e}")
                self._digest = ""
        digest = self._digest or ""
        running = NodeStatusRunningImage(digest=f"sha256:{digest}" if digest else "")
        if self.boot_info is None:
            return running
        try:
            with open(self.boot_info, "rb") as f:
                info = parse_boot_info(f.read(MAX_BOOT_INFO + 1))
        except FileNotFoundError:
            self._tell(f"no boot info at {self.boot_info}: the slot is reported as none")
            return running
        except (OSError, BootInfoError) as e:
            self._tell(f"boot info {self.boot_info} is unusable ({e}): slot reported as none")
            return running
        if digest and info.image_sha256 != digest:
            self._tell(
                f"boot info {self.boot_info} names image {info.image_sha256}, but this node "
                f"runs {digest}: reporting the image's own digest"
            )
        if not digest:
            running.digest = f"sha256:{info.image_sha256}"
        running.slot = _SLOTS[info.slot]
        running.trial = info.trial
        if info.rolled_back_sha256:
            running.rolled_back_digest = f"sha256:{info.rolled_back_sha256}"
            running.rollback_cause = info.rollback_cause
        return running

    async def read(self) -> NodeStatusRunningImage:
        """`read_sync` in a thread. Cancellable (the thread finishes on its own)."""
        return await trio.to_thread.run_sync(self.read_sync, abandon_on_cancel=True)
