"""etcd snapshots of the local member: written atomically, checksummed, with a manifest.

A snapshot is two files, FILE and FILE.manifest
(:mod:`metropolis.consensus.snapshotfile`, whose names this module exports
too). Both are written under ``.tmp`` names, fsynced, renamed (FILE first), and
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
from pathlib import Path
from typing import Any

import trio

from common.durable import publish_with_sidecar
from metropolis.consensus.snapshotfile import (
    ETCD_HASH_SIZE,
    FORMAT,
    MANIFEST_SUFFIX,
    SnapshotError,
    SnapshotManifest,
    check_etcd_hash,
    cluster_identity,
    manifest_path,
    verify_snapshot,
)
from metropolis.consensus.unixhttp import TransportError, UnixHTTP

__all__ = [
    "FORMAT",
    "MANIFEST_SUFFIX",
    "SnapshotError",
    "SnapshotManifest",
    "cluster_identity",
    "manifest_path",
    "take_snapshot",
    "verify_snapshot",
]


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
                        tail = (tail + chunk)[-ETCD_HASH_SIZE:]
                finally:
                    stream.close()
            if size <= ETCD_HASH_SIZE:
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
        await trio.to_thread.run_sync(check_etcd_hash, data_tmp, data_tmp)
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
