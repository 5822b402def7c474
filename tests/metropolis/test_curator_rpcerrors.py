"""The curator answers an etcd that cannot answer now as UNAVAILABLE (which
callers retry), everything else as the server's INTERNAL."""

from __future__ import annotations

from metropolis.consensus.client import GRPC_UNAVAILABLE, EtcdAPIError, EtcdUnavailable
from metropolis.curator.rpcerrors import unavailable_consensus
from metropolis.rpc import Status


def test_an_etcd_electing_a_leader_or_unreachable_is_unavailable() -> None:
    for error in (
        EtcdAPIError("etcdserver: leader changed", GRPC_UNAVAILABLE, 503),
        EtcdUnavailable("no socket"),
    ):
        answer = unavailable_consensus(error)
        assert answer is not None and answer.code is Status.UNAVAILABLE
        assert str(error) in str(answer)


def test_other_errors_are_left_to_the_server() -> None:
    assert unavailable_consensus(EtcdAPIError("etcdserver: member not found", 5, 404)) is None
    assert unavailable_consensus(ValueError("bug")) is None
