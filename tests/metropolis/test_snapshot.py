"""etcd snapshots: a node process with ``--snapshot-interval`` keeps the newest
N, each whole and of its cluster; ``owner snapshot --out FILE`` writes one on
demand. A snapshot cut short or changed in one byte is refused."""

from __future__ import annotations

import hashlib
import json
import signal
import sys
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from common.net import free_loopback_port
from metropolis import pki
from metropolis.consensus.snapshot import (
    FORMAT,
    SnapshotError,
    manifest_path,
    verify_snapshot,
)
from metropolis.identity import NodeCredentials
from metropolis.localstorage import Root
from metropolis.roleserve.snapshots import PREFIX, prune
from tests.metropolis.test_node_cli import LEADS, bootstrap_args, node


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _snapshots(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob(f"{PREFIX}*.db"))


async def test_scheduled_and_owner_snapshots_are_whole_and_of_their_cluster(
    tmp_path: Path,
) -> None:
    root = Root(tmp_path / "n")
    folder = root.data.path / "snapshots"
    port = free_loopback_port()
    args = [
        *bootstrap_args(tmp_path),
        *("--snapshot-interval", "0.5", "--snapshot-keep", "2"),
        *("--metrics-listen", f"127.0.0.1:{port}"),
    ]
    with trio.fail_after(90):
        async with node(*args) as proc:
            await proc.wait_for(LEADS)
            # Pruned at least once: more were taken than are kept.
            await proc.wait_for("removed (keeping 2)")
            async with httpx.AsyncClient() as http:
                texts: list[str] = []

                async def scrape() -> None:
                    texts.append((await http.get(f"http://127.0.0.1:{port}/metrics")).text)

                # Scrapes at once share one read of etcd: at most one a second.
                started = trio.current_time()
                async with trio.open_nursery() as nursery:
                    for _ in range(10):
                        nursery.start_soon(scrape)
                elapsed = trio.current_time() - started
                reads = set()
                for text in texts:
                    samples = _samples(text)
                    assert samples[("metropolis_etcd_up", ())] == 1
                    reads.add(samples[("metropolis_etcd_reads_total", ())])
                assert max(reads) - min(reads) <= elapsed + 1, (reads, elapsed)
            samples = _samples(texts[-1])
            ok = ("metropolis_etcd_snapshots_total", (("outcome", "ok"),))
            assert samples[ok] >= 3
            assert samples[("metropolis_etcd_snapshots_total", (("outcome", "failed"),))] == 0
            assert 0 <= samples[("metropolis_etcd_snapshot_age_seconds", ())] < 10
            out = tmp_path / "owner.snap"
            done = await trio.run_process(
                [
                    *(sys.executable, "-m", "metropolis", "owner", "--root", str(root.path)),
                    *("--owner-key", str(tmp_path / "owner.pem"), "snapshot", "--out", str(out)),
                ],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert done.returncode == 0, done.stderr.decode()
            assert b"sha256" in done.stdout
            proc.process.send_signal(signal.SIGTERM)
    assert proc.process.returncode == 0
    _check_snapshots(root, folder, out)


def _check_snapshots(root: Root, folder: Path, out: Path) -> None:
    tmp_path = out.parent
    kept = _snapshots(folder)
    # The newest two; a stop between a snapshot and its pruning leaves one more.
    assert len(kept) in (2, 3), kept
    kept = kept[-2:]
    credentials = NodeCredentials.load(root.data.node_credentials)
    ca = hashlib.sha256(credentials.ca_certificate.public_bytes(pki.Encoding.DER)).hexdigest()
    for path in [*kept, out]:
        manifest = verify_snapshot(path)
        assert manifest.format == FORMAT
        assert manifest.cluster_ca_sha256 == ca
        assert manifest.node_id == credentials.node_id
        assert manifest.revision > 1 and manifest.size == path.stat().st_size
    assert not list(folder.glob("*.tmp")) and not list(tmp_path.glob("*.tmp"))
    assert folder.stat().st_mode & 0o077 == 0 and out.stat().st_mode & 0o077 == 0

    # Damaged copies are refused: cut, one byte changed (manifest fixed up to
    # match: etcd's own hash still catches it), or the manifest gone.
    data = out.read_bytes()
    meta = json.loads(manifest_path(out).read_bytes())
    cut = tmp_path / "cut.snap"
    cut.write_bytes(data[: len(data) - 100])
    manifest_path(cut).write_bytes(manifest_path(out).read_bytes())
    with pytest.raises(SnapshotError, match="cut or grown"):
        verify_snapshot(cut)
    flipped = tmp_path / "flipped.snap"
    changed = bytearray(data)
    changed[len(changed) // 2] ^= 1
    flipped.write_bytes(changed)
    manifest_path(flipped).write_text(
        json.dumps(meta | {"sha256": hashlib.sha256(changed).hexdigest()})
    )
    with pytest.raises(SnapshotError, match="etcd's hash"):
        verify_snapshot(flipped)
    manifest_path(flipped).write_text(json.dumps(meta))
    with pytest.raises(SnapshotError, match="SHA-256 differs"):
        verify_snapshot(flipped)
    bare = tmp_path / "bare.snap"
    bare.write_bytes(data)
    with pytest.raises(SnapshotError, match="manifest"):
        verify_snapshot(bare)


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for stamp in ("20260101T000000.000000Z", "20260102T000000.000000Z", "20260103T000000.000000Z"):
        (tmp_path / f"{PREFIX}{stamp}.db").write_bytes(b"x")
        manifest_path(tmp_path / f"{PREFIX}{stamp}.db").write_bytes(b"{}")
    (tmp_path / "other.db").write_bytes(b"not ours")
    gone = prune(tmp_path, 1)
    assert [p.name for p in gone] == [
        f"{PREFIX}20260101T000000.000000Z.db",
        f"{PREFIX}20260102T000000.000000Z.db",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "other.db",
        f"{PREFIX}20260103T000000.000000Z.db",
        f"{PREFIX}20260103T000000.000000Z.db.manifest",
    ]
