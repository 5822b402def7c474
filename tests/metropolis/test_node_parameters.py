"""Node parameters files: built from 'owner info --out', written, and read back strictly."""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from common.durable import atomic_write
from metropolis import pki
from metropolis.errors import MetropolisError
from metropolis.proto import common, configuration, parameters
from metropolis.proto.management import GetClusterInfoResponse
from metropolis.proto.parameters import NodeParametersError

OWNER = pki.public_key_bytes(pki.generate_key())
TICKET = b"\x01" * 16


def _cluster_info() -> GetClusterInfoResponse:
    """What the curator answers GetClusterInfo with (and 'owner info --out' writes)."""
    ca = pki.new_ca(pki.generate_key(), "cluster CA")
    return GetClusterInfoResponse(
        cluster_directory=common.ClusterDirectory(
            nodes=[
                common.ClusterDirectoryNode(
                    public_key=pki.public_key_bytes(pki.generate_key()),
                    addresses=[common.ClusterDirectoryNodeAddress(host=host)],
                )
                for host in ("10.0.0.1", "10.0.0.2")
            ]
        ),
        ca_certificate=pki.encode_certificate(ca, pki.Encoding.DER),
    )


@pytest.fixture
def info_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.info"
    atomic_write(path, bytes(_cluster_info()))  # as 'owner info --out' does
    return path


def test_from_owner_info_to_a_file_and_back(info_file: Path, tmp_path: Path) -> None:
    info = parameters.read_cluster_info(info_file)
    params = parameters.register_parameters(info, TICKET, OWNER)
    out = tmp_path / "node.params"
    parameters.write(out, params)
    # It holds the register ticket: the owner's only.
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    back = parameters.read(out)
    assert back == params
    assert back.cluster_register is not None
    assert back.cluster_register.register_ticket == TICKET
    assert back.cluster_register.owner_public_key == OWNER
    assert parameters.cluster_info(back) == info
    assert parameters.decode(parameters.encode(params), "x") == params


def _broken(change: Callable[[configuration.NodeParametersClusterRegister], None]) -> bytes:
    params = parameters.register_parameters(_cluster_info(), TICKET, OWNER)
    assert params.cluster_register is not None
    change(params.cluster_register)
    return bytes(params)


def _set(name: str, value: object) -> Callable[[configuration.NodeParametersClusterRegister], None]:
    return lambda register: setattr(register, name, value)


def _node(change: Callable[[common.ClusterDirectoryNode], None]) -> Callable[..., None]:
    def apply(register: configuration.NodeParametersClusterRegister) -> None:
        assert register.cluster_directory is not None
        change(register.cluster_directory.nodes[1])

    return apply


CA_PEM = pki.encode_certificate(pki.new_ca(pki.generate_key(), "ca"))

BROKEN = {
    "no directory": (_broken(_set("cluster_directory", None)), "no cluster_directory"),
    "empty directory": (
        _broken(_set("cluster_directory", common.ClusterDirectory())),
        "no cluster_directory",
    ),
    "short node key": (
        _broken(_node(lambda n: setattr(n, "public_key", b"k" * 31))),
        "node 1: public key is 31",
    ),
    "node without address": (
        _broken(_node(lambda n: setattr(n, "addresses", []))),
        "node 1: no address",
    ),
    "empty host": (
        _broken(_node(lambda n: setattr(n, "addresses", [common.ClusterDirectoryNodeAddress()]))),
        "node 1: no address",
    ),
    "no ticket": (_broken(_set("register_ticket", b"")), "no register_ticket"),
    "no CA": (_broken(_set("ca_certificate", b"")), "no ca_certificate"),
    "CA garbage": (_broken(_set("ca_certificate", b"\x30\x03abc")), "not DER X.509"),
    "CA in PEM": (_broken(_set("ca_certificate", CA_PEM)), "not DER X.509"),
    "no owner key": (_broken(_set("owner_public_key", b"")), "owner_public_key is 0 bytes"),
    "short owner key": (
        _broken(_set("owner_public_key", OWNER[:31])),
        "owner_public_key is 31 bytes",
    ),
    "bootstrap": (
        bytes(
            configuration.NodeParameters(
                cluster_bootstrap=configuration.NodeParametersClusterBootstrap(
                    owner_public_key=OWNER
                )
            )
        ),
        "bootstrap parameters, want cluster_register",
    ),
    "empty": (b"", "no parameters, want cluster_register"),
    "text": (b"cluster = prod\n", "not a node parameters message"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_file_that_cannot_be_used_is_an_error_naming_it(tmp_path: Path, case: str) -> None:
    data, match = BROKEN[case]
    path = tmp_path / "node.params"
    path.write_bytes(data)
    with pytest.raises(NodeParametersError, match=match) as caught:
        parameters.read(path)
    assert str(path) in str(caught.value)
    assert isinstance(caught.value, MetropolisError)
    # Nor can such parameters be written or encoded.
    params = configuration.NodeParameters.parse(data)
    with pytest.raises(NodeParametersError):
        parameters.write(tmp_path / "other", params)
    assert not (tmp_path / "other").exists()


def test_every_truncation_of_a_good_file_is_refused(tmp_path: Path) -> None:
    data = bytes(parameters.register_parameters(_cluster_info(), TICKET, OWNER))
    path = tmp_path / "node.params"
    for end in range(len(data)):
        path.write_bytes(data[:end])
        with pytest.raises(NodeParametersError, match=str(path)):
            parameters.read(path)


def test_unreadable_and_oversized_files(tmp_path: Path) -> None:
    with pytest.raises(NodeParametersError, match="cannot read"):
        parameters.read(tmp_path / "missing")
    with pytest.raises(NodeParametersError, match="cannot read"):
        parameters.read(tmp_path)  # a directory
    big = tmp_path / "big"
    big.write_bytes(b"\0" * (parameters.MAX_FILE_SIZE + 1))
    with pytest.raises(NodeParametersError, match="over"):
        parameters.read(big)


def test_write_into_a_missing_folder(tmp_path: Path) -> None:
    params = parameters.register_parameters(_cluster_info(), TICKET, OWNER)
    with pytest.raises(NodeParametersError, match="cannot write"):
        parameters.write(tmp_path / "nowhere" / "node.params", params)


def test_cluster_info_files_are_read_strictly(info_file: Path, tmp_path: Path) -> None:
    data = info_file.read_bytes()
    info_file.write_bytes(data[:-3])
    with pytest.raises(NodeParametersError, match="not a cluster info file"):
        parameters.read_cluster_info(info_file)
    info_file.write_bytes(bytes(GetClusterInfoResponse(ca_certificate=b"x")))
    with pytest.raises(NodeParametersError, match="no cluster_directory"):
        parameters.read_cluster_info(info_file)


def test_building_from_bad_parts_is_refused() -> None:
    info = _cluster_info()
    with pytest.raises(NodeParametersError, match="no register_ticket"):
        parameters.register_parameters(info, b"", OWNER)
    with pytest.raises(NodeParametersError, match="owner_public_key"):
        parameters.register_parameters(info, TICKET, b"")
    with pytest.raises(NodeParametersError, match="no ca_certificate"):
        parameters.register_parameters(
            GetClusterInfoResponse(cluster_directory=info.cluster_directory), TICKET, OWNER
        )
