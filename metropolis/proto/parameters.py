"""Node parameters files: a serialized NodeParameters that tells a new node which cluster to join.

The fleet half builds one for each machine it installs (and sends it in
``MetropolisInstallationRequest.node_parameters``); an operator can build
one by hand from what ``metropolis owner info --out FILE`` writes (a
serialized ``GetClusterInfoResponse``: the cluster CA and directory), the
register ticket and the owner's public key. The node half reads it to
register.

Reading is strict (see `common.protobuf`): a file that is not the
exact encoding of a NodeParameters, or whose ClusterRegister lacks one of
its fields or holds one that cannot be right (a directory node without a
32-byte key or an address, a CA certificate that is not DER X.509, an owner
key that is not 32 bytes), is a `NodeParametersError` naming the file.
Bootstrap parameters (``cluster_bootstrap``) are not accepted: a node
bootstraps from the command line, not from a file.
"""

from __future__ import annotations

from pathlib import Path

from cryptography import x509

from common.durable import atomic_write
from common.protobuf import parse_strict
from metropolis.errors import MetropolisError
from metropolis.proto.common import ClusterDirectory
from metropolis.proto.configuration import NodeParameters, NodeParametersClusterRegister
from metropolis.proto.management import GetClusterInfoResponse

__all__ = [
    "MAX_FILE_SIZE",
    "NodeParametersError",
    "cluster_info",
    "decode",
    "encode",
    "read",
    "read_cluster_info",
    "register_parameters",
    "write",
]

#: Bound on a file read here, bytes: a real one is a few kilobytes (a CA
#: certificate and a handful of directory entries).
MAX_FILE_SIZE = 1 << 20

_KEY_SIZE = 32


class NodeParametersError(MetropolisError):
    """A node parameters (or cluster info) file or message that cannot be
    used: unreadable, not a valid encoding, or missing what registering needs.
    The message names the file (or what the bytes came from)."""


def register_parameters(
    cluster: GetClusterInfoResponse, ticket: bytes, owner_public_key: bytes
) -> NodeParameters:
    """NodeParameters that register a node into ``cluster`` with ``ticket``,
    for the owner whose raw Ed25519 public key is ``owner_public_key``.

    `NodeParametersError` if any of them is missing or malformed.
    """
    params = NodeParameters(
        cluster_register=NodeParametersClusterRegister(
            cluster_directory=cluster.cluster_directory,
            register_ticket=ticket,
            ca_certificate=cluster.ca_certificate,
            owner_public_key=owner_public_key,
        )
    )
    _check(params, "the parameters")
    return params


def cluster_info(params: NodeParameters) -> GetClusterInfoResponse:
    """The cluster CA and directory of checked register parameters, in the
    form ``owner info --out`` writes (what the register flow takes)."""
    register = params.cluster_register
    if register is None:
        raise ValueError("not register parameters")
    return GetClusterInfoResponse(
        cluster_directory=register.cluster_directory, ca_certificate=register.ca_certificate
    )


def encode(params: NodeParameters) -> bytes:
    """The serialized ``params``, after the checks `decode` makes."""
    _check(params, "the parameters")
    return bytes(params)


def decode(data: bytes, source: str) -> NodeParameters:
    """Strictly parse register parameters; `NodeParametersError` naming ``source``."""
    try:
        params = parse_strict(NodeParameters, data)
    except ValueError as e:
        raise NodeParametersError(f"{source}: not a node parameters message: {e}") from e
    _check(params, source)
    return params


def read(path: Path) -> NodeParameters:
    """The register parameters in the file ``path`` (blocking I/O)."""
    return decode(_read(path), str(path))


def write(path: Path, params: NodeParameters) -> None:
    """Check ``params`` and write them to ``path`` atomically, readable by
    the owner only: they hold the register ticket (blocking I/O)."""
    data = encode(params)
    try:
        atomic_write(path, data)
    except OSError as e:
        raise NodeParametersError(f"{path}: cannot write: {e.strerror or e}") from e


def read_cluster_info(path: Path) -> GetClusterInfoResponse:
    """Strictly read a file written by ``metropolis owner info --out``
    (blocking I/O); `NodeParametersError` naming it if it is not one, or
    lacks the CA certificate or a usable directory."""
    try:
        info = parse_strict(GetClusterInfoResponse, _read(path))
    except ValueError as e:
        raise NodeParametersError(f"{path}: not a cluster info file: {e}") from e
    _check_cluster(info.cluster_directory, info.ca_certificate, str(path))
    return info


def _read(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_SIZE + 1)
    except OSError as e:
        raise NodeParametersError(f"{path}: cannot read: {e.strerror or e}") from e
    if len(data) > MAX_FILE_SIZE:
        raise NodeParametersError(f"{path}: over {MAX_FILE_SIZE} bytes")
    return data


def _check(params: NodeParameters, source: str) -> None:
    register = params.cluster_register
    if register is None:
        what = "bootstrap" if params.cluster_bootstrap is not None else "no"
        raise NodeParametersError(f"{source}: {what} parameters, want cluster_register")
    _check_cluster(register.cluster_directory, register.ca_certificate, source)
    if not register.register_ticket:
        raise NodeParametersError(f"{source}: no register_ticket")
    if len(register.owner_public_key) != _KEY_SIZE:
        raise NodeParametersError(
            f"{source}: owner_public_key is {len(register.owner_public_key)} bytes,"
            f" want {_KEY_SIZE} (raw Ed25519)"
        )


def _check_cluster(directory: ClusterDirectory | None, ca_certificate: bytes, source: str) -> None:
    if directory is None or not directory.nodes:
        raise NodeParametersError(f"{source}: no cluster_directory nodes")
    for i, node in enumerate(directory.nodes):
        if len(node.public_key) != _KEY_SIZE:
            raise NodeParametersError(
                f"{source}: directory node {i}: public key is {len(node.public_key)} bytes,"
                f" want {_KEY_SIZE}"
            )
        if not node.addresses or not all(a.host for a in node.addresses):
            raise NodeParametersError(f"{source}: directory node {i}: no address")
    if not ca_certificate:
        raise NodeParametersError(f"{source}: no ca_certificate")
    try:
        x509.load_der_x509_certificate(ca_certificate)
    except ValueError as e:
        raise NodeParametersError(f"{source}: ca_certificate is not DER X.509: {e}") from e
