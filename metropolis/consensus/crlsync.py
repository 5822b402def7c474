"""CRL sync: etcd's peer CRL key, watched and written to the file etcd reads.

etcd re-reads its peer CRL file for every new peer connection; revoking a
node's peer certificate (``Status.remove_node`` on any member) changes the
CRL in etcd, and :func:`sync_crl` on every member writes it to disk.
"""

from __future__ import annotations

import logging
from pathlib import Path

import trio

from common.backoff import ExponentialBackoff, Retrier
from common.durable import atomic_write
from metropolis import pki
from metropolis.consensus import peerpki
from metropolis.consensus.client import KV, Client, EtcdUnavailable
from metropolis.supervisor import Node

__all__ = ["has_content", "sync_crl"]


#: Between tries while etcd cannot be reached.
_RETRY_BACKOFF = ExponentialBackoff(initial=0.05, maximum=2.0)


async def sync_crl(node: Node, client: Client, path: Path) -> None:
    """Keep ``path`` equal to the CRL in etcd.

    etcd re-reads the CRL file for every new peer connection but never
    checks its signature, so only CRLs signed by the peer CA are written;
    anything else in etcd is logged and the last good list stays in force.

    While etcd cannot be reached (for the first read, or to open the watch:
    once open, the watch reconnects by itself), that is logged and tried
    again through :data:`_RETRY_BACKOFF`: etcd may be going away, its
    member removed, and the consensus service then stops this runnable.
    Other errors are raised, for the supervisor to restart it.
    """
    kv = client.namespaced(peerpki.NAMESPACE)
    retrier = Retrier(_RETRY_BACKOFF)
    while True:
        try:
            await _follow(node, kv, path, retrier)
        except EtcdUnavailable as e:
            node.logger.info("cannot follow the CRL now: %s", e)
            await retrier.sleep()


async def _follow(node: Node, kv: KV, path: Path, retrier: Retrier) -> None:
    """Write the CRL in etcd to ``path``, then every new one, until cancelled.

    ``retrier`` is reset once the CRL is read: a later failure starts over.
    """
    ca = await peerpki.load_ca(kv)
    current = await kv.get(peerpki.KEY_CRL)
    if current is None:
        raise peerpki.PeerPKIError("no CRL in etcd")
    await _apply_crl(current.value, ca, path, node.logger)
    retrier.reset()
    node.signal_healthy()
    async with kv.watch(peerpki.KEY_CRL, start_revision=current.mod_revision + 1) as watch:
        async for response in watch:
            for event in response.events:
                if event.type == "PUT":
                    await _apply_crl(event.kv.value, ca, path, node.logger)
                else:
                    node.logger.error("CRL deleted from etcd; keeping the last one")


async def _apply_crl(raw: bytes, ca: peerpki.PeerCA, path: Path, logger: logging.Logger) -> None:
    """Write ``raw`` to ``path`` if it is a CRL signed by ``ca``; log and keep the old one if not.

    The write (with fsync) runs in a worker thread; a cancellation waits for
    it, so the file is always the old or the new list.
    """
    try:
        crl = pki.decode_crl(raw)
        pki.verify_crl(crl, ca.certificate)
    except pki.PKIError as e:
        logger.error("ignoring bad CRL from etcd, keeping the last one: %s", e)
        return
    encoded = pki.encode_crl(crl)
    if has_content(path, encoded):
        # Every start reads the CRL back from etcd, and it is usually the
        # one on disk: an fsync saved on the start path.
        return
    await trio.to_thread.run_sync(atomic_write, path, encoded)
    logger.info("CRL written (%d revoked)", len(list(crl)))


def has_content(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() == data
    except OSError:
        return False
