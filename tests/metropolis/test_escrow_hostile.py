"""Hostile callers of the owner's escrow (``AAA.Escrow``, `metropolis.curator.aaa`),
against a real curator over real TLS with a real etcd.

A proof of possession replayed, made by another key, for another method or
request, out of its time window, malformed, or made by the owner of
another cluster; parameters of every shape. Held means: refused with the
status the docs name, no certificate sent, nothing issued (the curator's
"issued an owner certificate" log line counts what it issues) and nothing
written to etcd.

(A proof names no cluster: the owner of two clusters, if one key owned
both, could be replayed from one to the other within the proof window. It
would obtain a certificate for the owner's own key, of no use without the
owner's private key; the CLI makes a new owner key for every cluster.)
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metropolis import pki
from metropolis.proto import aaa
from metropolis.rpc import RPCError, Status, client_context, methods, open_client, sign_proof
from metropolis.rpc.auth import KEY_HEADER, PROOF_WINDOW, SIGNATURE_HEADER, TIME_HEADER
from tests.metropolis.test_curator_api import Cluster, cluster

ISSUED = "issued an owner certificate"
#: The date, in milliseconds, of the last proof `proof` made.
_last_millis = 0


async def escrow(
    cl: Cluster,
    metadata: Mapping[str, str],
    messages: list[aaa.EscrowFromClient],
) -> bytes:
    """Call Escrow with this proof metadata and these messages; the certificate sent."""
    async with (
        open_client([cl.endpoint], client_context(cl.ca)) as client,
        client.bidi(methods.ESCROW, metadata=metadata) as call,
    ):
        for message in messages:
            await call.send(message)
        await call.done_sending()
        return b"".join([a.emitted_certificate async for a in call])


def owner_asks(key: bytes, name: str = "owner") -> list[aaa.EscrowFromClient]:
    return [
        aaa.EscrowFromClient(
            parameters=aaa.EscrowFromClientParameters(requested_identity_name=name, public_key=key)
        )
    ]


def proof(
    key: Ed25519PrivateKey, *, path: str = methods.ESCROW.path, now: float | None = None
) -> dict[str, str]:
    """A proof of possession of ``key`` for a call to ``path`` (a stream's covers b"").

    Dated ``now``, or the clock's time but never the same millisecond as
    the proof before: two proofs of one key and call dated alike are the
    same bytes, which the curator takes once. (Subtracting a counter from
    the clock is not enough: the clock can move on by just as much between
    two calls.)
    """
    global _last_millis
    millis = int((time.time() if now is None else now) * 1000)
    if now is None:
        millis = max(millis, _last_millis + 1)
        _last_millis = millis
    # Half a millisecond in, so that sign_proof's truncation gives ``millis``.
    return sign_proof(key, path, b"", now=(millis + 0.5) / 1000)


async def refused(
    cl: Cluster, metadata: Mapping[str, str], messages: list[aaa.EscrowFromClient]
) -> RPCError:
    with pytest.raises(RPCError) as caught:
        certificate = await escrow(cl, metadata, messages)
        assert certificate == b"", "a certificate was sent"
    return caught.value


def issued(caplog: pytest.LogCaptureFixture) -> int:
    return sum(ISSUED in r.getMessage() for r in caplog.records)


async def test_escrow_refuses_replayed_foreign_stale_and_malformed_proofs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="metropolis.curator.aaa")
    async with cluster(tmp_path / "a") as cl:
        owner = cl.owner_key
        owner_raw = pki.public_key_bytes(owner)
        stranger = pki.generate_key()
        before = (await cl.kv.range(b"/", prefix=True)).revision

        # One good proof buys one certificate; the same proof again, nothing.
        good = proof(owner)
        certificate = pki.decode_certificate(await escrow(cl, good, owner_asks(owner_raw)))
        pki.verify_signed_by(certificate, cl.ca)
        assert issued(caplog) == 1
        replay = await refused(cl, good, owner_asks(owner_raw))
        assert replay.code is Status.UNAUTHENTICATED and "already used" in replay.message

        now = time.time()
        forged_key = dict(proof(stranger), **{KEY_HEADER: good[KEY_HEADER]})
        cases: list[tuple[str, dict[str, str], list[aaa.EscrowFromClient], Status, str]] = [
            # Another key's proof: for the owner's key, or for its own.
            (
                "stranger for owner",
                proof(stranger),
                owner_asks(owner_raw),
                Status.UNIMPLEMENTED,
                "",
            ),
            (
                "stranger for itself",
                proof(stranger),
                owner_asks(pki.public_key_bytes(stranger)),
                Status.PERMISSION_DENIED,
                "",
            ),
            (
                "owner's key, stranger's signature",
                forged_key,
                owner_asks(owner_raw),
                Status.UNAUTHENTICATED,
                "does not verify",
            ),
            # The owner's proof, but for something else.
            (
                "another method",
                proof(owner, path=methods.REGISTER_NODE.path),
                owner_asks(owner_raw),
                Status.UNAUTHENTICATED,
                "does not verify",
            ),
            (
                "a request",
                sign_proof(
                    owner, methods.ESCROW.path, bytes(owner_asks(owner_raw)[0]), now=now - 0.5
                ),
                owner_asks(owner_raw),
                Status.UNAUTHENTICATED,
                "does not verify",
            ),
            (
                "stale",
                proof(owner, now=now - 2 * PROOF_WINDOW),
                owner_asks(owner_raw),
                Status.UNAUTHENTICATED,
                "not fresh",
            ),
            (
                "future",
                proof(owner, now=now + 2 * PROOF_WINDOW),
                owner_asks(owner_raw),
                Status.UNAUTHENTICATED,
                "not fresh",
            ),
            # Malformed metadata.
            (
                "no signature",
                {k: v for k, v in proof(owner).items() if k != SIGNATURE_HEADER},
                owner_asks(owner_raw),
                Status.UNAUTHENTICATED,
                "missing",
            ),
            (
                "short key",
                dict(proof(owner), **{KEY_HEADER: base64.b64encode(b"k" * 31).decode()}),
                owner_asks(owner_raw),
                Status.UNAUTHENTICATED,
                "malformed",
            ),
            (
                "Arabic-Indic time",
                dict(proof(owner), **{TIME_HEADER: "١٢٣"}),
                owner_asks(owner_raw),
                Status.UNAUTHENTICATED,
                "malformed",
            ),
            (
                "signature not base64",
                dict(proof(owner), **{SIGNATURE_HEADER: "***"}),
                owner_asks(owner_raw),
                Status.UNAUTHENTICATED,
                "",
            ),
            # A good proof, and parameters it does not cover.
            ("no parameters", proof(owner), [aaa.EscrowFromClient()], Status.INVALID_ARGUMENT, ""),
            ("no message", proof(owner), [], Status.INVALID_ARGUMENT, ""),
            (
                "another identity",
                proof(owner),
                owner_asks(owner_raw, "root"),
                Status.UNIMPLEMENTED,
                "",
            ),
            (
                "another key",
                proof(owner),
                owner_asks(pki.public_key_bytes(stranger)),
                Status.UNIMPLEMENTED,
                "",
            ),
        ]
        for name, metadata, messages, code, why in cases:
            error = await refused(cl, metadata, messages)
            assert error.code is code, (name, error)
            assert why in error.message, (name, error.message)
        assert issued(caplog) == 1

        # The owner of another cluster: its fresh proof, and a proof of this
        # cluster's owner that it captured, are refused alike.
        async with cluster(tmp_path / "b") as other:
            other_owner = other.owner_key
            other_before = (await other.kv.range(b"/", prefix=True)).revision
            foreign = await refused(
                cl, proof(other_owner), owner_asks(pki.public_key_bytes(other_owner))
            )
            assert foreign.code is Status.PERMISSION_DENIED, foreign
            captured = proof(owner)
            carried = await refused(other, captured, owner_asks(owner_raw))
            assert carried.code is Status.PERMISSION_DENIED, carried
            assert (await other.kv.range(b"/", prefix=True)).revision == other_before
        assert issued(caplog) == 1
        assert (await cl.kv.range(b"/", prefix=True)).revision == before

        # Any parameters with a fresh proof of the owner's: only the exact
        # ones are served.
        token = trio.lowlevel.current_trio_token()

        @settings(
            max_examples=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(
            name=st.one_of(
                st.sampled_from(["owner", "Owner", "owner\x00", " owner", "ownér", ""]),
                st.text(max_size=30),
            ),
            key=st.one_of(
                st.just(owner_raw),
                st.binary(max_size=64),
                st.just(owner_raw + b"\x00"),
                st.just(owner_raw[:31]),
            ),
        )
        def any_parameters(name: str, key: bytes) -> None:
            exact = name == "owner" and key == owner_raw
            count = issued(caplog)

            async def call() -> None:
                if exact:
                    assert await escrow(cl, proof(owner), owner_asks(key, name))
                else:
                    error = await refused(cl, proof(owner), owner_asks(key, name))
                    assert error.code in (
                        Status.INVALID_ARGUMENT,
                        Status.UNIMPLEMENTED,
                    ), error

            trio.from_thread.run(call, trio_token=token)
            assert issued(caplog) == count + exact

        await trio.to_thread.run_sync(any_parameters)
        assert (await cl.kv.range(b"/", prefix=True)).revision == before
