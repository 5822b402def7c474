"""etcd snapshots of the local member: written atomically, checksummed, with a manifest.

A snapshot is two files::

    FILE            etcd's own snapshot (maintenance Snapshot), byte for byte:
                    ``etcdctl snapshot restore FILE`` takes it as it is;
                    its last 32 bytes are etcd's SHA-256 of the rest
    FILE.manifest   JSON: format, the cluster's identity (its CA's SHA-256,
                    etcd's cluster id), the member and node it came from,
                    the revision and raft term, when, size and SHA-256 of FILE

Both are written under ``.tmp`` names, fsynced, renamed (FILE first), and
the folder fsynced: a reader that finds the manifest finds FILE whole. A
snapshot is only taken as valid when :func:`verify_snapshot` says so: the
manifest parses, FILE has its size and SHA-256, and etcd's own hash at its
end matches (so a file cut or changed anywhere is refused).

Cancellation: a cancelled :func:`take_snapshot` removes its ``.tmp`` files
and closes its connection; nothing is at FILE unless it finished.
Errors: :class:`SnapshotError` (a :class:`~metropolis.errors.ConsensusError`)
with one line naming the file or what etcd said.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from common.durable import publish_with_sidecar
from metropolis.consensus.unixhttp import TransportError, UnixHTTP
from metropolis.errors import ConsensusError

__all__ = [
    "FORMAT",
    "SnapshotError",
    "SnapshotManifest",
    "cluster_identity",
    "take_snapshot",
    "verify_snapshot",
]

#: The manifest's ``format`` field.
FORMAT = "metropolis-etcd-snapshot/1"
#: The manifest sits beside the snapshot under this suffix.
MANIFEST_SUFFIX = ".manifest"
_CHUNK = 1 << 20
#: Bytes of etcd's SHA-256 at the end of its snapshot.
_HASH = 32


def cluster_identity(ca_certificate: x509.Certificate) -> str:
    """The cluster's identity as a manifest names it: the SHA-256 (hex) of
    its CA certificate's DER encoding."""
    return hashlib.sha256(ca_certificate.public_bytes(serialization.Encoding.DER)).hexdigest()


class SnapshotError(ConsensusError):
    """A snapshot could not be taken, or a file is not a whole snapshot."""


@dataclass(frozen=True)
class SnapshotManifest:
    format: str
    #: SHA-256 (hex) of the cluster CA certificate (DER): the cluster's identity.
    cluster_ca_sha256: str
    #: etcd's cluster and member IDs, as etcd reports them (decimal).
    etcd_cluster_id: str
    etcd_member_id: str
    node_id: str
    revision: int
    raft_term: int
    #: UTC, ISO 8601, when the snapshot was asked of etcd.
    taken_at: str
    size: int
    sha256: str

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, where: Path) -> SnapshotManifest:
        try:
            raw = json.loads(data)
            fields = {name: raw[name] for name in cls.__dataclass_fields__}
            manifest = cls(**fields)
        except (ValueError, TypeError, KeyError) as e:
            raise SnapshotError(f"{where}: not a snapshot manifest ({e})") from None
        if manifest.format != FORMAT:
            raise SnapshotError(f"{where}: format {manifest.format!r}, want {FORMAT!r}")
        for name in ("revision", "raft_term", "size"):
            if not isinstance(getattr(manifest, name), int):
                raise SnapshotError(f"{where}: {name} is not a number")
        return manifest


def manifest_path(path: Path) -> Path:
    return path.with_name(path.name + MANIFEST_SUFFIX)


def _publish(data_tmp: Path, out: Path, manifest: SnapshotManifest) -> None:
    publish_with_sidecar(data_tmp, out, manifest_path(out), manifest.to_json(), 0o600)


async def _status(http: UnixHTTP) -> dict[str, Any]:
    code, body = await http.post("/v3/maintenance/status", b"{}")
    if code != 200:
        raise SnapshotError(f"etcd status: HTTP {code}")
    try:
        status: dict[str, Any] = json.loads(body)
        return status
    except ValueError as e:
        raise SnapshotError(f"etcd status: not JSON ({e})") from None


async def take_snapshot(
    socket_path: Path, out: Path, *, cluster_ca_sha256: str, node_id: str, limit: float = 60.0
) -> SnapshotManifest:
    """Snapshot the member behind ``socket_path`` into ``out`` and its manifest.

    ``limit`` (seconds) bounds the whole transfer. See the module docstring.
    """
    out = Path(await trio.Path(out).absolute())
    data_tmp = out.with_name(out.name + ".tmp")
    http = UnixHTTP(socket_path, timeout=limit, connect_timeout=min(limit, 5.0), host="etcd")
    taken_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    try:
        with trio.fail_after(limit):
            status = await _status(http)
            digest = hashlib.sha256()
            size = 0
            tail = b""
            fd = os.open(data_tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                stream = await http.open_stream(
                    "/v3/maintenance/snapshot", b"{}", head_timeout=limit
                )
                try:
                    if stream.status != 200:
                        answer = await stream.read_all()
                        raise SnapshotError(
                            f"etcd snapshot: HTTP {stream.status}: {answer[:200]!r}"
                        )
                    while (line := await stream.line()) is not None:
                        if not line.strip():
                            continue
                        chunk = _blob(line)
                        f.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                        tail = (tail + chunk)[-_HASH:]
                finally:
                    stream.close()
            if size <= _HASH:
                raise SnapshotError(f"etcd snapshot: only {size} bytes")
        header = status.get("header", {})
        manifest = SnapshotManifest(
            format=FORMAT,
            cluster_ca_sha256=cluster_ca_sha256,
            etcd_cluster_id=str(header.get("cluster_id", "")),
            etcd_member_id=str(header.get("member_id", "")),
            node_id=node_id,
            revision=int(header.get("revision", 0)),
            raft_term=int(status.get("raftTerm", 0)),
            taken_at=taken_at,
            size=size,
            sha256=digest.hexdigest(),
        )
        # etcd's own hash, checked before the file gets its name.
        await trio.to_thread.run_sync(_check_etcd_hash, data_tmp, data_tmp)
        await trio.to_thread.run_sync(_publish, data_tmp, out, manifest)
    except TransportError as e:
        raise SnapshotError(f"etcd snapshot: {e}") from e
    except trio.TooSlowError:
        raise SnapshotError(f"etcd snapshot: not done within {limit} s") from None
    finally:
        http.close()
        data_tmp.unlink(missing_ok=True)
        manifest_path(out).with_name(manifest_path(out).name + ".tmp").unlink(missing_ok=True)
    return manifest


def _blob(line: bytes) -> bytes:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise SnapshotError(f"etcd snapshot: not JSON ({e})") from None
    if "error" in obj:
        raise SnapshotError(f"etcd snapshot: {obj['error'].get('message', obj['error'])}")
    try:
        return base64.b64decode(obj["result"].get("blob", ""), validate=True)
    except (KeyError, AttributeError, binascii.Error) as e:
        raise SnapshotError(f"etcd snapshot: unexpected message ({e!r})") from None


def _check_etcd_hash(path: Path, where: Path) -> None:
    """SnapshotError unless the last 32 bytes of ``path`` are the SHA-256 of the rest."""
    size = path.stat().st_size
    if size <= _HASH:
        raise SnapshotError(f"{where}: {size} bytes: not an etcd snapshot")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        left = size - _HASH
        while left:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                raise SnapshotError(f"{where}: shorter than it was a moment ago")
            digest.update(chunk)
            left -= len(chunk)
        if f.read() != digest.digest():
            raise SnapshotError(f"{where}: etcd's hash at the end does not match: damaged")


def verify_snapshot(path: Path) -> SnapshotManifest:
    """The manifest of the snapshot at ``path``, once the file is checked whole (blocking)."""
    meta = manifest_path(path)
    try:
        manifest = SnapshotManifest.from_json(meta.read_bytes(), meta)
    except OSError as e:
        raise SnapshotError(f"{meta}: cannot read the manifest: {e.strerror or e}") from None
    try:
        size = path.stat().st_size
    except OSError as e:
        raise SnapshotError(f"{path}: {e.strerror or e}") from None
    if size != manifest.size:
        raise SnapshotError(
            f"{path}: {size} bytes, the manifest says {manifest.size}: cut or grown"
        )
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != manifest.sha256:
        raise SnapshotError(f"{path}: SHA-256 differs from the manifest's: damaged")
    _check_etcd_hash(path, path)
    return manifest
