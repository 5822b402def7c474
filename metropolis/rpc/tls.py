"""TLS contexts for the curator RPC: TLS 1.3, Ed25519, ALPN ``h2``, cluster CA.

The **server** presents its node certificate and *requests* a client
certificate (``CERT_OPTIONAL``): callers that register or join have none yet
and prove possession of a key instead (:mod:`metropolis.rpc.auth`). A
certificate that is presented must chain to the cluster CA and be within its
validity period, or OpenSSL refuses the handshake (Python's ``ssl`` offers
no callback to accept it and decide later); our client reports that as
UNAUTHENTICATED, a Go client as UNAVAILABLE ("authentication handshake
failed"), which is what a Go server with the same policy would cause.
Revocation is checked per call against the curator's current CRL, not in
the handshake, because the CRL changes while the server runs.

The **client** verifies the server against the cluster CA. Node
certificates name the node ID, not an address, so host names are not
checked; the client checks instead that the server's key is the one the
cluster directory lists for that address (:func:`check_server_key`).

gRPC requires TLS 1.2+ and ALPN ``h2``; we require TLS 1.3, which every
Ed25519-capable gRPC implementation speaks.
"""

from __future__ import annotations

import functools
import os
import ssl
from typing import Any, Protocol

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes

from metropolis import pki
from metropolis.identity import NodeCredentials
from metropolis.rpc.status import RPCError, Status

#: Ed25519 in the cluster; other types only where a test peer needs them.
PrivateKey = CertificateIssuerPrivateKeyTypes

#: Contexts kept for reuse. A node's role fetch, directory watch and status
#: push call with the same credentials, and its debug service and curator
#: serve with them: each new context costs CPU (OpenSSL parses the CA, the
#: certificate and the key), all spent on the Trio thread at the moment the
#: node comes home, when its curator campaigns. A context is safe to
#: share between connections as long as nobody changes it after creation.
#: Private keys compare by identity, so a reloaded key gets a new context.
_CACHED = 16

__all__ = [
    "check_server_key",
    "client_context",
    "peer_certificate",
    "server_context",
    "server_context_for",
]


def _load_chain(context: ssl.SSLContext, certificate: x509.Certificate, key: PrivateKey) -> None:
    # load_cert_chain only reads files. An anonymous in-memory file keeps the
    # private key off every disk; /proc/self/fd makes it a path.
    pem = pki.encode_certificate(certificate) + key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.memfd_create("metropolis-rpc-credentials", os.MFD_CLOEXEC)
    try:
        os.write(fd, pem)
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _base(purpose: ssl.Purpose, ca_certificate: x509.Certificate) -> ssl.SSLContext:
    # The cluster CA and nothing else. Without cadata here, a client context
    # would also load (and trust) the system's public CAs, parsed again at
    # the start of every role fetch, status push and owner call.
    context = ssl.create_default_context(
        purpose, cadata=pki.encode_certificate(ca_certificate, pki.Encoding.DER)
    )
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.set_alpn_protocols(["h2"])
    return context


def server_context(credentials: NodeCredentials) -> ssl.SSLContext:
    """Context for a curator serving with ``credentials`` (its node certificate).

    Shared, as :func:`server_context_for` says: treat it as read-only.
    """
    return server_context_for(
        credentials.certificate, credentials.private_key, credentials.ca_certificate
    )


def server_context_for(
    certificate: x509.Certificate, key: PrivateKey, ca_certificate: x509.Certificate
) -> ssl.SSLContext:
    """Like :func:`server_context`, for a certificate and key of any type TLS takes.

    For tests against peers that cannot verify Ed25519 (grpcio's BoringSSL).
    The same certificate, key (object) and CA give the same context object:
    see :data:`_CACHED`. Treat it as read-only.
    """
    return _server_context(certificate, key, ca_certificate)


@functools.lru_cache(maxsize=_CACHED)
def _server_context(
    certificate: x509.Certificate, key: PrivateKey, ca_certificate: x509.Certificate
) -> ssl.SSLContext:
    context = _base(ssl.Purpose.CLIENT_AUTH, ca_certificate)
    context.verify_mode = ssl.CERT_OPTIONAL
    _load_chain(context, certificate, key)
    return context


def client_context(
    ca_certificate: x509.Certificate,
    certificate: x509.Certificate | None = None,
    key: PrivateKey | None = None,
) -> ssl.SSLContext:
    """Context for calling curators of the cluster with ``ca_certificate``.

    ``certificate`` and ``key`` (an Ed25519 private key) are the caller's
    identity: a node certificate or the owner's; None to call with a proof
    of possession only. The same arguments (the key: the same object) give
    the same context object, see :data:`_CACHED`. Treat it as read-only.
    """
    if certificate is not None and key is None:
        raise ValueError("a client certificate needs its private key")
    return _client_context(ca_certificate, certificate, key)


@functools.lru_cache(maxsize=_CACHED)
def _client_context(
    ca_certificate: x509.Certificate,
    certificate: x509.Certificate | None,
    key: PrivateKey | None,
) -> ssl.SSLContext:
    context = _base(ssl.Purpose.SERVER_AUTH, ca_certificate)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    if certificate is not None and key is not None:
        _load_chain(context, certificate, key)
    return context


class _HasPeerCertificate(Protocol):
    def getpeercert(self, binary_form: bool = ...) -> Any: ...


def peer_certificate(stream: _HasPeerCertificate) -> x509.Certificate | None:
    """The certificate the peer presented (already verified by the handshake), if any."""
    der = stream.getpeercert(binary_form=True)
    return None if der is None else x509.load_der_x509_certificate(der)


def check_server_key(stream: _HasPeerCertificate, expected: bytes | None) -> None:
    """Raise UNAVAILABLE if the server's key is not ``expected`` (None: any CA-issued key)."""
    if expected is None:
        return
    certificate = peer_certificate(stream)
    got = (
        None
        if certificate is None
        else pki.public_key_bytes(pki.certificate_public_key(certificate))
    )
    if got != expected:
        raise RPCError(Status.UNAVAILABLE, "curator's key is not the one the directory lists")
