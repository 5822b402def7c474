"""bench.etcdclient's verdict: the node switches to the native client only if it is no slower."""

from __future__ import annotations

from bench.etcdclient import NOISE, verdict


def test_a_client_slower_on_any_operation_keeps_the_gateway() -> None:
    said = verdict({"range": 0.8, "put": 2.59, "txn": 1.0, "watch event": 0.9})
    assert "keeps the JSON gateway" in said
    assert "2.59x" in said and "per put" in said


def test_a_client_within_noise_on_every_operation_may_switch() -> None:
    said = verdict({"range": NOISE, "put": 0.7, "txn": 1.0, "watch event": 0.95})
    assert "may switch" in said
    assert "worst range" in said
