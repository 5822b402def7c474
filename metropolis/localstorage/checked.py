"""Checked files: the node's state behind a header of kind, length and SHA-256.

See the package's docstring for why (protobuf cannot tell a cut file from a
shorter message) and the header's format.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TypeVar

import betterproto2

from common.durable import atomic_write
from common.numbers import parse_decimal
from metropolis.localstorage.errors import CorruptFile
from metropolis.localstorage.fs import PRIVATE_FILE_MODE, read_file

__all__ = ["checked_content", "parse_checked", "read_checked", "write_checked"]

_MAGIC = b"METROPOLIS-FILE"
_VERSION = b"1"
#: Magic, version, a kind, twelve digits of length and 64 of digest fit well within.
_MAX_HEADER = 160

_Message = TypeVar("_Message", bound=betterproto2.Message)


def checked_content(kind: str, payload: bytes) -> bytes:
    """``payload`` behind its header line: what :func:`write_checked` writes."""
    digest = hashlib.sha256(payload).hexdigest().encode()
    return b" ".join([_MAGIC, _VERSION, kind.encode(), b"%d" % len(payload), digest]) + (
        b"\n" + payload
    )


def write_checked(
    path: Path, kind: str, payload: bytes, mode: int = PRIVATE_FILE_MODE, *, durable: bool = True
) -> None:
    """:func:`atomic_write` ``payload`` behind a header of ``kind``, length and digest."""
    atomic_write(path, checked_content(kind, payload), mode, durable=durable)


def read_checked(path: Path, kind: str, *, advice: str = "") -> bytes:
    """The payload :func:`write_checked` stored in ``path`` as ``kind``.

    Raises :class:`LocalStorageError` if the file cannot be read (missing,
    a symlink), :class:`CorruptFile` (its message ending in ``advice``) if
    it has no valid header, is of another kind, or its payload does not
    match the header's length and SHA-256. Never modifies the file.
    """
    raw = read_file(path)

    def corrupt(reason: str) -> CorruptFile:
        return CorruptFile(path, reason, advice)

    end = raw.find(b"\n", 0, _MAX_HEADER)
    if not raw:
        raise corrupt("it is empty")
    if not raw.startswith(_MAGIC + b" "):
        if _MAGIC.startswith(raw[: len(_MAGIC)]):
            raise corrupt(f"cut short inside its header ({len(raw)} bytes)")
        raise corrupt(
            "no METROPOLIS-FILE header (not written by this version of metropolis, "
            "so damage cannot be told from content)"
        )
    if end < 0:
        raise corrupt(f"cut short inside its header ({len(raw)} bytes)")
    fields = raw[:end].split(b" ")
    payload = raw[end + 1 :]
    if len(fields) != 5:
        raise corrupt("malformed header")
    _, version, found_kind, length_text, digest = fields
    if version != _VERSION:
        shown = version.decode("ascii", "replace")
        raise corrupt(f"format version {shown!r} (this metropolis reads version 1)")
    if found_kind != kind.encode():
        raise corrupt(f"it holds a {found_kind.decode('ascii', 'replace')!r} file, not {kind!r}")
    try:
        length = parse_decimal(length_text, max_digits=12, what="payload length")
    except ValueError as e:
        raise corrupt(f"malformed header ({e})") from None
    if len(payload) < length:
        raise corrupt(f"cut short: {len(payload)} of {length} bytes")
    if len(payload) > length:
        raise corrupt(f"{len(payload) - length} bytes more than its header says")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise corrupt("its content does not match its SHA-256 (changed after it was written)")
    return payload


def parse_checked(
    path: Path, message_type: type[_Message], payload: bytes, *, advice: str = ""
) -> _Message:
    """``payload`` (read from ``path``) parsed as ``message_type``; :class:`CorruptFile` if not.

    After :func:`read_checked` a payload that does not parse was written by
    something else (another version), not damaged.
    """
    try:
        return message_type.parse(payload)
    # betterproto2 raises assorted errors on bad input, hence the broad catch.
    except Exception as e:
        raise CorruptFile(
            path, f"does not parse as {message_type.__name__} ({type(e).__name__}: {e})", advice
        ) from e
