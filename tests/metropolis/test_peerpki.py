"""The peer PKI stored in etcd: one CA however many ask, reuse, concurrent revocation."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
from cryptography import x509

from metropolis import identity, pki
from metropolis.consensus import peerpki
from metropolis.consensus.client import KV, Client
from metropolis.consensus.localetcd import EtcdServer


@pytest.fixture
async def pki_kv(etcd: EtcdServer) -> AsyncIterator[KV]:
    async with Client(etcd.socket_path) as client:
        yield client.namespaced(peerpki.NAMESPACE)


async def test_load_before_bootstrap_is_a_clear_error(pki_kv: KV) -> None:
    with pytest.raises(peerpki.PeerPKIError, match="not bootstrapped"):
        await peerpki.load_ca(pki_kv)
    with pytest.raises(peerpki.PeerPKIError, match="not bootstrapped"):
        await peerpki.get_crl(pki_kv)


async def test_concurrent_ensure_agrees_on_one_ca(pki_kv: KV) -> None:
    results: list[peerpki.PeerCA] = []

    async def ensure() -> None:
        results.append(await peerpki.ensure_ca(pki_kv))

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(ensure)
    assert len({r.certificate.serial_number for r in results}) == 1
    assert {pki.public_key_bytes(r.key) for r in results} == {
        pki.public_key_bytes(pki.certificate_public_key(results[0].certificate))
    }
    loaded = await peerpki.load_ca(pki_kv)
    assert loaded.certificate == results[0].certificate
    crl, _ = await peerpki.get_crl(pki_kv)
    pki.verify_crl(crl, loaded.certificate)
    assert list(crl) == []


async def test_peer_certificates_are_reused_until_hosts_change(pki_kv: KV) -> None:
    ca = await peerpki.ensure_ca(pki_kv)
    public = pki.public_key_bytes(pki.generate_key())
    first = await peerpki.issue_peer_certificate(pki_kv, ca, public, ["127.0.0.1"])
    assert first.subject.rfc4514_string() == f"CN={identity.node_id(public)}"
    pki.verify_signed_by(first, ca.certificate)
    assert await peerpki.issue_peer_certificate(pki_kv, ca, public, ["127.0.0.1"]) == first

    moved = await peerpki.issue_peer_certificate(
        pki_kv, ca, public, ["node.example", identity.node_id(public)]
    )
    assert moved != first
    sans = moved.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [identity.node_id(public), "node.example"]
    stored = await pki_kv.get(peerpki.KEY_CERTIFICATES + identity.node_id(public).encode())
    assert stored is not None and pki.decode_certificate(stored.value) == moved


async def test_concurrent_revocations_are_all_kept(pki_kv: KV) -> None:
    ca = await peerpki.ensure_ca(pki_kv)
    nodes = []
    for _ in range(4):
        public = pki.public_key_bytes(pki.generate_key())
        cert = await peerpki.issue_peer_certificate(pki_kv, ca, public, ["127.0.0.1"])
        nodes.append((identity.node_id(public), cert))

    async with trio.open_nursery() as nursery:
        for node_id, _ in nodes:
            nursery.start_soon(peerpki.revoke_peer_certificate, pki_kv, ca, node_id)
    crl, _ = await peerpki.get_crl(pki_kv)
    pki.verify_crl(crl, ca.certificate)
    assert all(pki.is_revoked(crl, cert) for _, cert in nodes)

    with pytest.raises(peerpki.PeerPKIError, match="no peer certificate"):
        await peerpki.revoke_peer_certificate(pki_kv, ca, "metropolis-unknown")
