"""An etcd snapshot on disk: its manifest, and the check that the file is whole.

The format of what :mod:`metropolis.consensus.snapshot` writes (see there
for how), apart so that a reader (``node recover``'s check, before its
etcdctl starts) needs neither Trio nor an etcd client::

    FILE            etcd's own snapshot (maintenance Snapshot), byte for byte:
                    ``etcdctl snapshot restore FILE`` takes it as it is;
                    its last 32 bytes are etcd's SHA-256 of the rest
    FILE.manifest   JSON: format, the cluster's identity (its CA's SHA-256,
                    etcd's cluster id), the member and node it came from,
                    the revision and raft term, when, size and SHA-256 of FILE

A snapshot is only taken as valid when :func:`verify_snapshot` says so: the
manifest parses, FILE has its size and SHA-256, and etcd's own hash at its
end matches (so a file cut or changed anywhere is refused). Errors:
:class:`SnapshotError` (a :class:`~metropolis.errors.ConsensusError`) with
one line naming the file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from metropolis.errors import ConsensusError

__all__ = [
    "ETCD_HASH_SIZE",
    "FORMAT",
    "MANIFEST_SUFFIX",
    "SnapshotError",
    "SnapshotManifest",
    "check_etcd_hash",
    "cluster_identity",
    "manifest_path",
    "verify_snapshot",
]

#: The manifest's ``format`` field.
FORMAT = "metropolis-etcd-snapshot/1"
#: The manifest sits beside the snapshot under this suffix.
MANIFEST_SUFFIX = ".manifest"
_CHUNK = 1 << 20
#: Bytes of etcd's SHA-256 at the end of its snapshot.
ETCD_HASH_SIZE = 32


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


def check_etcd_hash(path: Path, where: Path) -> None:
    """SnapshotError unless the last 32 bytes of ``path`` are the SHA-256 of the rest."""
    size = path.stat().st_size
    if size <= ETCD_HASH_SIZE:
        raise SnapshotError(f"{where}: {size} bytes: not an etcd snapshot")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        left = size - ETCD_HASH_SIZE
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
    check_etcd_hash(path, path)
    return manifest
