"""The curator RPC over real TLS on loopback, with a small test service.

Every refusal is checked twice: the caller gets the right gRPC status, and
the handler never ran. The wire is checked against Google's gRPC runtime
(grpcio), which is what a Go client's behaviour is specified by.
"""

from __future__ import annotations

import datetime
import math
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import pytest
import trio
from cryptography import x509
from cryptography.x509.oid import NameOID

from metropolis import identity, pki
from metropolis.proto.common import (
    ClusterDirectory,
    ClusterDirectoryNode,
    ClusterDirectoryNodeAddress,
)
from metropolis.rpc import (
    CURATOR_PORT,
    Access,
    CallContext,
    Endpoint,
    LeaderHint,
    Leadership,
    Method,
    RPCError,
    Server,
    ServerSecurity,
    Status,
    auth,
    client_context,
    endpoints_from_directory,
    open_client,
    server_context,
    wire,
)
from metropolis.rpc.method import STALE_OK_HEADER
from metropolis.rpc.tls import server_context_for
from tests.fixtures.rpc import ClusterPKI as Cluster
from tests.fixtures.rpc import ecdsa_leaf, issue_node

# The test service: requests and responses are ClusterDirectory messages, whose
# first node's public key carries the caller's identity back.
WHO_NODE = Method("/test.Test/WhoNode", ClusterDirectory, ClusterDirectory, Access.NODE)
WHO_OWNER = Method("/test.Test/WhoOwner", ClusterDirectory, ClusterDirectory, Access.OWNER)
REGISTER = Method("/test.Test/Register", ClusterDirectory, ClusterDirectory, Access.PROOF)
ANY_LEADER = Method(
    "/test.Test/Anywhere", ClusterDirectory, ClusterDirectory, Access.NODE, leader_only=False
)
STALE_OK = Method(
    "/test.Test/StaleOk", ClusterDirectory, ClusterDirectory, Access.NODE, stale_ok=True
)
WATCH = Method("/test.Test/Watch", ClusterDirectory, ClusterDirectory, Access.NODE, streaming=True)
FAIL = Method("/test.Test/Fail", ClusterDirectory, ClusterDirectory, Access.NODE)
ECHO = Method(
    "/test.Test/Echo",
    ClusterDirectory,
    ClusterDirectory,
    Access.NODE,
    streaming=True,
    client_streaming=True,
)
ECHO_PROOF = Method(
    "/test.Test/EchoProof",
    ClusterDirectory,
    ClusterDirectory,
    Access.PROOF,
    streaming=True,
    client_streaming=True,
)


def _who(key: bytes) -> ClusterDirectory:
    return ClusterDirectory(nodes=[ClusterDirectoryNode(public_key=key)])


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return Cluster.new()


@dataclass
class State:
    """What the test service saw, and the hooks' answers the test can change."""

    owner: bytes
    calls: list[str] = field(default_factory=list)
    crl: x509.CertificateRevocationList | None = None
    leadership: Leadership = field(default_factory=lambda: Leadership(is_leader=True))
    watch_cancelled: trio.Event = field(default_factory=trio.Event)
    watch_sent: int = 0
    echo_cancelled: trio.Event = field(default_factory=trio.Event)
    #: grpc-timeout header of each Watch call (None: no deadline sent).
    watch_timeouts: list[str | None] = field(default_factory=list)


async def _who_handler(state: State, req: ClusterDirectory, ctx: CallContext) -> ClusterDirectory:
    state.calls.append(ctx.method.path)
    return ClusterDirectory(
        nodes=[ClusterDirectoryNode(public_key=ctx.peer.public_key), *req.nodes]
    )


@asynccontextmanager
async def running_server(
    cluster: Cluster, state: State, context: ssl.SSLContext | None = None
) -> AsyncIterator[int]:
    security = ServerSecurity(
        owner_key=lambda: state.owner,
        crl=lambda: state.crl,
        leadership=lambda: state.leadership,
    )
    server = Server(context or server_context(cluster.server), security)

    async def who(req: ClusterDirectory, ctx: CallContext) -> ClusterDirectory:
        return await _who_handler(state, req, ctx)

    async def fail(req: ClusterDirectory, ctx: CallContext) -> ClusterDirectory:
        state.calls.append(ctx.method.path)
        if req.nodes:
            raise RPCError(Status.NOT_FOUND, "no such node: ünïcode % ok")
        raise ValueError("a bug")

    async def watch(
        req: ClusterDirectory, ctx: CallContext, send: Callable[[ClusterDirectory], object]
    ) -> None:
        state.calls.append(ctx.method.path)
        state.watch_timeouts.append(ctx.metadata.get("grpc-timeout"))
        count = len(req.nodes)
        try:
            for i in range(count):
                await send(_who(bytes([i]) * 32))  # type: ignore[misc]
                state.watch_sent += 1
            if count >= 3:
                return  # a stream that ends by itself
            await trio.sleep_forever()
        except trio.Cancelled:
            state.watch_cancelled.set()
            raise

    async def echo(
        requests: trio.MemoryReceiveChannel[ClusterDirectory],
        ctx: CallContext,
        send: Callable[[ClusterDirectory], Awaitable[None]],
    ) -> None:
        """Answers each request with the caller's key and the request's nodes."""
        state.calls.append(ctx.method.path)
        try:
            async for req in requests:
                await send(
                    ClusterDirectory(
                        nodes=[ClusterDirectoryNode(public_key=ctx.peer.public_key), *req.nodes]
                    )
                )
        except trio.Cancelled:
            state.echo_cancelled.set()
            raise

    server.bidi(ECHO, echo)
    server.bidi(ECHO_PROOF, echo)
    for method in (WHO_NODE, WHO_OWNER, REGISTER, ANY_LEADER, STALE_OK):
        server.unary(method, who)
    server.unary(FAIL, fail)
    server.stream(WATCH, watch)
    async with trio.open_nursery() as nursery:
        port: int = await nursery.start(server.serve, "127.0.0.1", 0)
        yield port
        nursery.cancel_scope.cancel()


@pytest.fixture
async def server(cluster: Cluster) -> AsyncIterator[tuple[int, State]]:
    state = State(owner=pki.public_key_bytes(cluster.owner_key))
    async with running_server(cluster, state) as port:
        yield port, state


def _node_context(
    cluster: Cluster, creds: identity.NodeCredentials | None = None
) -> ssl.SSLContext:
    creds = creds or cluster.node
    return client_context(cluster.ca, creds.certificate, creds.private_key)


def test_contexts_are_made_once_per_identity(cluster: Cluster) -> None:
    """A node's services share their contexts (each costs ms of CPU as the node comes home)."""
    creds = cluster.node
    assert _node_context(cluster) is _node_context(cluster)
    assert server_context(cluster.server) is server_context(cluster.server)
    assert client_context(cluster.ca) is client_context(cluster.ca)
    assert client_context(cluster.ca) is not _node_context(cluster)
    # Another key object (even for the same key) is another identity.
    reloaded = pki.decode_private_key(pki.encode_private_key(creds.private_key))
    assert client_context(cluster.ca, creds.certificate, reloaded) is not _node_context(cluster)
    with pytest.raises(ValueError, match="private key"):
        client_context(cluster.ca, creds.certificate)


def test_contexts_trust_the_cluster_ca_only(cluster: Cluster) -> None:
    """Neither side trusts the system's public CAs (loading them cost 0.2 s a client)."""
    der = pki.encode_certificate(cluster.ca, pki.Encoding.DER)
    for context in (_node_context(cluster), server_context(cluster.server)):
        assert context.get_ca_certs(binary_form=True) == [der]
        assert context.cert_store_stats()["x509_ca"] == 1


# --- identities that reach the handler -----------------------------------------


async def test_node_and_owner_reach_their_handlers_as_themselves(
    cluster: Cluster, server: tuple[int, State]
) -> None:
    port, state = server
    endpoints = [Endpoint("127.0.0.1", port, cluster.server.public_key)]
    async with open_client(endpoints, _node_context(cluster)) as client:
        got = await client.unary(WHO_NODE, _who(b"x" * 32))
        assert got.nodes[0].public_key == cluster.node.public_key
        assert got.nodes[1].public_key == b"x" * 32  # the request arrived intact
        with pytest.raises(RPCError) as e:
            await client.unary(WHO_OWNER, ClusterDirectory())
        assert e.value.code is Status.PERMISSION_DENIED

    owner = client_context(cluster.ca, cluster.owner_cert, cluster.owner_key)
    async with open_client(endpoints, owner) as client:
        got = await client.unary(WHO_OWNER, ClusterDirectory())
        assert got.nodes[0].public_key == pki.public_key_bytes(cluster.owner_key)
        with pytest.raises(RPCError) as e:
            await client.unary(WHO_NODE, ClusterDirectory())
        assert e.value.code is Status.PERMISSION_DENIED
    assert state.calls == [WHO_NODE.path, WHO_OWNER.path]


async def test_proof_of_possession_reaches_the_handler_without_a_certificate(
    cluster: Cluster, server: tuple[int, State]
) -> None:
    port, state = server
    key = pki.generate_key()
    async with open_client(
        [Endpoint("127.0.0.1", port)], client_context(cluster.ca), proof_key=key
    ) as client:
        got = await client.unary(REGISTER, _who(b"r" * 32))
    assert got.nodes[0].public_key == pki.public_key_bytes(key)
    assert state.calls == [REGISTER.path]


# --- refusals: right status, handler never called ----------------------------------


async def _refused(
    port: int,
    context: ssl.SSLContext,
    method: Method[ClusterDirectory, ClusterDirectory],
    metadata: dict[str, str] | None = None,
) -> RPCError:
    async with open_client([Endpoint("127.0.0.1", port)], context) as client:
        with pytest.raises(RPCError) as e:
            await client.unary(method, ClusterDirectory(), metadata=metadata)
    return e.value


async def test_certificate_from_another_ca_is_refused(
    cluster: Cluster, server: tuple[int, State]
) -> None:
    port, state = server
    other_ca_key = pki.generate_key()
    foreign = issue_node(other_ca_key, pki.new_ca(other_ca_key, "other CA"))
    error = await _refused(port, _node_context(cluster, foreign), WHO_NODE)
    assert error.code is Status.UNAUTHENTICATED, error
    assert "UNKNOWN_CA" in error.message
    assert state.calls == []


async def test_expired_certificate_is_refused(cluster: Cluster, server: tuple[int, State]) -> None:
    port, state = server
    key = pki.generate_key()
    now = datetime.datetime.now(datetime.UTC)
    expired = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.node_id(key.public_key()))])
        )
        .issuer_name(cluster.ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=2))
        .not_valid_after(now - datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(cluster.ca_key, None)
    )
    error = await _refused(port, client_context(cluster.ca, expired, key), WHO_NODE)
    assert error.code is Status.UNAUTHENTICATED, error
    assert "EXPIRED" in error.message
    assert state.calls == []


async def test_revoked_certificate_is_refused(cluster: Cluster, server: tuple[int, State]) -> None:
    port, state = server
    revoked = issue_node(cluster.ca_key, cluster.ca)
    state.crl = pki.new_crl(cluster.ca_key, cluster.ca, [revoked.certificate.serial_number])
    error = await _refused(port, _node_context(cluster, revoked), WHO_NODE)
    assert error.code is Status.UNAUTHENTICATED
    assert "revoked" in error.message
    # The same CRL does not stop a node that is not on it.
    async with open_client([Endpoint("127.0.0.1", port)], _node_context(cluster)) as client:
        await client.unary(WHO_NODE, ClusterDirectory())
    assert state.calls == [WHO_NODE.path]


async def test_no_certificate_is_refused(cluster: Cluster, server: tuple[int, State]) -> None:
    port, state = server
    for method in (WHO_NODE, WHO_OWNER, WATCH):
        async with open_client([Endpoint("127.0.0.1", port)], client_context(cluster.ca)) as c:
            with pytest.raises(RPCError) as e:
                if method is WATCH:
                    async with c.stream(WATCH, ClusterDirectory()) as updates:
                        async for _ in updates:
                            pass
                else:
                    await c.unary(method, ClusterDirectory())
        assert e.value.code is Status.UNAUTHENTICATED
        assert "no client certificate" in e.value.message
    assert state.calls == []


async def test_bad_proofs_of_possession_are_refused(
    cluster: Cluster, server: tuple[int, State]
) -> None:
    port, state = server
    key = pki.generate_key()
    request = bytes(ClusterDirectory())
    good = auth.sign_proof(key, REGISTER.path, request)
    wrong_method = auth.sign_proof(key, WHO_NODE.path, request)
    wrong_request = auth.sign_proof(key, REGISTER.path, bytes(_who(b"y" * 32)))
    stale = auth.sign_proof(key, REGISTER.path, request, now=time.time() - auth.PROOF_WINDOW * 2)
    other_key = dict(
        good, **{auth.KEY_HEADER: auth.sign_proof(pki.generate_key(), "/a/b", b"")[auth.KEY_HEADER]}
    )
    missing = {k: v for k, v in good.items() if k != auth.SIGNATURE_HEADER}
    cases = {
        "missing": (missing, "missing"),
        "wrong method": (wrong_method, "does not verify"),
        "wrong request": (wrong_request, "does not verify"),
        "other key": (other_key, "does not verify"),
        "stale": (stale, "not fresh"),
    }
    plain = client_context(cluster.ca)
    for name, (metadata, why) in cases.items():
        error = await _refused(port, plain, REGISTER, metadata)
        assert error.code is Status.UNAUTHENTICATED, name
        assert why in error.message, (name, error.message)
    assert state.calls == []

    # A good proof works once; replayed, it is refused.
    async with open_client([Endpoint("127.0.0.1", port)], plain) as client:
        await client.unary(REGISTER, ClusterDirectory(), metadata=good)
    error = await _refused(port, plain, REGISTER, good)
    assert error.code is Status.UNAUTHENTICATED
    assert "already used" in error.message
    assert state.calls == [REGISTER.path]


async def test_a_certificate_that_is_neither_node_nor_owner_is_refused(
    cluster: Cluster, server: tuple[int, State]
) -> None:
    port, state = server
    key = pki.generate_key()
    # From the cluster CA, but its name is not the node ID of its key.
    impostor = pki.issue_certificate(
        cluster.ca_key, cluster.ca, key.public_key(), cluster.node.node_id, pki.Usage.CLIENT
    )
    for method in (WHO_NODE, WHO_OWNER):
        error = await _refused(port, client_context(cluster.ca, impostor, key), method)
        assert error.code is Status.UNAUTHENTICATED
        assert "neither" in error.message
    assert state.calls == []


async def test_messages_larger_than_the_flow_control_window(
    cluster: Cluster, server: tuple[int, State]
) -> None:
    port, state = server
    big = bytes(range(256)) * (3 * 4096)  # 3 MiB: three times the window
    async with open_client([Endpoint("127.0.0.1", port)], _node_context(cluster)) as client:
        got = await client.unary(WHO_NODE, _who(big))
        assert got.nodes[1].public_key == big
        with pytest.raises(RPCError) as e:
            await client.unary(WHO_NODE, _who(b"x" * (5 << 20)))
        assert e.value.code is Status.RESOURCE_EXHAUSTED
        # Answered before the request is in: the server resets the stream so
        # that the caller stops waiting for window to send the rest.
        unknown = Method("/test.Test/Nope", ClusterDirectory, ClusterDirectory, Access.NODE)
        with pytest.raises(RPCError) as e, trio.fail_after(60):
            await client.unary(unknown, _who(big))
        assert e.value.code is Status.UNIMPLEMENTED
        # The connection carries on.
        await client.unary(WHO_NODE, ClusterDirectory())
    assert state.calls == [WHO_NODE.path] * 2


async def test_many_concurrent_calls_and_streams_on_one_client(
    cluster: Cluster, server: tuple[int, State]
) -> None:
    port, state = server
    results: dict[int, bytes] = {}
    async with open_client([Endpoint("127.0.0.1", port)], _node_context(cluster)) as client:

        async def call(i: int) -> None:
            got = await client.unary(WHO_NODE, _who(i.to_bytes(4, "big") * 1000))
            results[i] = got.nodes[1].public_key

        async def watch() -> None:
            three = ClusterDirectory(nodes=[ClusterDirectoryNode()] * 3)
            async with client.stream(WATCH, three) as s:
                assert [m.nodes[0].public_key[0] async for m in s] == [0, 1, 2]

        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(call, i)
                if i % 10 == 0:
                    nursery.start_soon(watch)
    assert results == {i: i.to_bytes(4, "big") * 1000 for i in range(40)}
    assert state.calls.count(WHO_NODE.path) == 40


async def test_handler_errors_become_statuses(cluster: Cluster, server: tuple[int, State]) -> None:
    port, _ = server
    async with open_client([Endpoint("127.0.0.1", port)], _node_context(cluster)) as client:
        with pytest.raises(RPCError) as e:
            await client.unary(FAIL, _who(b"z" * 32))
        assert e.value.code is Status.NOT_FOUND
        assert e.value.message == "no such node: ünïcode % ok"
        with pytest.raises(RPCError) as e:
            await client.unary(FAIL, ClusterDirectory())
        assert e.value.code is Status.INTERNAL
        unknown = Method("/test.Test/Nope", ClusterDirectory, ClusterDirectory, Access.NODE)
        with pytest.raises(RPCError) as e:
            await client.unary(unknown, ClusterDirectory())
        assert e.value.code is Status.UNIMPLEMENTED
        # The connection survived all of that.
        await client.unary(WHO_NODE, ClusterDirectory())


# --- leadership and failover ----------------------------------------------------------


async def test_follower_names_the_leader_and_the_client_goes_there(cluster: Cluster) -> None:
    leader_state = State(owner=b"")
    follower_state = State(owner=b"")
    async with (
        running_server(cluster, leader_state) as leader_port,
        running_server(cluster, follower_state) as follower_port,
    ):
        follower_state.leadership = Leadership(
            is_leader=False, leader=LeaderHint("leader-id", f"127.0.0.1:{leader_port}")
        )
        follower = Endpoint("127.0.0.1", follower_port)
        leader = Endpoint("127.0.0.1", leader_port)
        async with open_client([follower], _node_context(cluster)) as client:
            # A method any curator may serve is answered by the follower.
            await client.unary(ANY_LEADER, ClusterDirectory())
            # Only the follower known: the client goes to the address it names.
            await client.unary(WHO_NODE, ClusterDirectory())
            assert client.endpoint == leader

        async with open_client([follower, leader], _node_context(cluster)) as client:
            await client.unary(WHO_NODE, ClusterDirectory())
            assert client.endpoint == leader
        # A follower that does not know the leader yet: the client tries the others.
        follower_state.leadership = Leadership(is_leader=False)
        async with open_client([follower, leader], _node_context(cluster)) as client:
            await client.unary(WHO_NODE, ClusterDirectory())
            assert client.endpoint == leader
        assert follower_state.calls == [ANY_LEADER.path]
        assert leader_state.calls == [WHO_NODE.path] * 3


async def test_a_follower_serves_a_stale_ok_method_only_when_asked(cluster: Cluster) -> None:
    state = State(owner=b"")
    state.leadership = Leadership(is_leader=False)
    async with (
        running_server(cluster, state) as port,
        open_client([Endpoint("127.0.0.1", port)], _node_context(cluster)) as client,
    ):
        for method in (STALE_OK, WHO_NODE):
            with pytest.raises(RPCError) as refused:
                await client.unary(method, ClusterDirectory())
            assert refused.value.code is Status.UNAVAILABLE
        # The header means nothing to a method that is not stale_ok.
        with pytest.raises(RPCError) as refused:
            await client.unary(WHO_NODE, ClusterDirectory(), metadata={STALE_OK_HEADER: "1"})
        assert refused.value.code is Status.UNAVAILABLE
        await client.unary(STALE_OK, ClusterDirectory(), metadata={STALE_OK_HEADER: "1"})
        assert state.calls == [STALE_OK.path]


async def test_follower_refusal_carries_the_leader(cluster: Cluster) -> None:
    state = State(owner=b"")
    hint = LeaderHint("metropolis-abc")
    state.leadership = Leadership(is_leader=False, leader=hint)
    async with running_server(cluster, state) as port:
        # The named leader is not in the client's list and has no address:
        # the caller learns who it is.
        async with open_client([Endpoint("127.0.0.1", port)], _node_context(cluster)) as client:
            with pytest.raises(RPCError) as e:
                await client.unary(WHO_NODE, ClusterDirectory())
        assert e.value.code is Status.UNAVAILABLE
        assert "not the leader" in e.value.message
        assert e.value.leader == hint
        # A leader's node ID (from the directory's public key) is enough to find it.
        key = pki.public_key_bytes(pki.generate_key())
        state.leadership = Leadership(is_leader=False, leader=LeaderHint(identity.node_id(key)))
        endpoints = [Endpoint("127.0.0.1", port), Endpoint("127.0.0.1", 1, key)]
        async with open_client(endpoints, _node_context(cluster)) as client:
            with pytest.raises(RPCError):
                await client.unary(WHO_NODE, ClusterDirectory())
            assert client.endpoint.port == 1  # it went to the leader (which is down)
    assert state.calls == []


async def test_client_moves_to_another_curator_when_one_stops(cluster: Cluster) -> None:
    first, second = State(owner=b""), State(owner=b"")
    async with running_server(cluster, second) as second_port:
        dead_port = 0
        async with trio.open_nursery() as outer:
            # Start the first server in its own scope so the test can stop it.
            scope = trio.CancelScope()

            async def run_first(task_status: trio.TaskStatus[int]) -> None:
                with scope:
                    async with running_server(cluster, first) as port:
                        task_status.started(port)
                        await trio.sleep_forever()

            dead_port = await outer.start(run_first)
            endpoints = [Endpoint("127.0.0.1", dead_port), Endpoint("127.0.0.1", second_port)]
            async with open_client(endpoints, _node_context(cluster)) as client:
                await client.unary(WHO_NODE, ClusterDirectory())
                assert first.calls == [WHO_NODE.path]
                scope.cancel()
                # The call in flight when the curator stops may or may not have
                # run there, so it fails; the next goes to the other curator.
                with trio.fail_after(30):
                    while True:
                        try:
                            await client.unary(WHO_NODE, ClusterDirectory())
                            break
                        except RPCError as e:
                            assert e.code is Status.UNAVAILABLE
                assert second.calls == [WHO_NODE.path]
                assert client.endpoint.port == second_port


# --- streaming ------------------------------------------------------------------


async def test_stream_delivers_messages_and_ends_with_ok(
    cluster: Cluster, server: tuple[int, State]
) -> None:
    port, _ = server
    three = ClusterDirectory(nodes=[ClusterDirectoryNode()] * 3)
    async with (
        open_client([Endpoint("127.0.0.1", port)], _node_context(cluster)) as client,
        client.stream(WATCH, three) as s,
    ):
        got = [m.nodes[0].public_key[0] async for m in s]
    assert got == [0, 1, 2]


async def test_client_leaving_a_stream_cancels_the_handler(
    cluster: Cluster, server: tuple[int, State]
) -> None:
    port, state = server
    async with open_client([Endpoint("127.0.0.1", port)], _node_context(cluster)) as client:
        async with client.stream(WATCH, ClusterDirectory(nodes=[ClusterDirectoryNode()])) as s:
            async for _ in s:
                break
        with trio.fail_after(30):
            await state.watch_cancelled.wait()
        # The connection carries on.
        await client.unary(WHO_NODE, ClusterDirectory())


async def test_cancelling_the_caller_cancels_the_handler(
    cluster: Cluster, server: tuple[int, State]
) -> None:
    port, state = server
    async with open_client([Endpoint("127.0.0.1", port)], _node_context(cluster)) as client:
        with trio.move_on_after(math.inf) as scope:
            async with client.stream(WATCH, ClusterDirectory(nodes=[ClusterDirectoryNode()])) as s:
                async for _ in s:
                    scope.cancel()
                    await trio.sleep_forever()
        with trio.fail_after(30):
            await state.watch_cancelled.wait()


async def test_server_stopping_ends_the_stream_with_unavailable(cluster: Cluster) -> None:
    state = State(owner=b"")
    async with trio.open_nursery() as outer:
        scope = trio.CancelScope()

        async def run(task_status: trio.TaskStatus[int]) -> None:
            with scope:
                async with running_server(cluster, state) as port:
                    task_status.started(port)
                    await trio.sleep_forever()

        port = await outer.start(run)
        async with open_client([Endpoint("127.0.0.1", port)], _node_context(cluster)) as client:
            with pytest.raises(RPCError) as e:
                async with client.stream(
                    WATCH, ClusterDirectory(nodes=[ClusterDirectoryNode()])
                ) as s:
                    async for _ in s:
                        scope.cancel()
            assert e.value.code is Status.UNAVAILABLE
    assert state.watch_cancelled.is_set()


async def test_deadline_is_sent_and_enforced(cluster: Cluster, server: tuple[int, State]) -> None:
    port, state = server
    one = ClusterDirectory(nodes=[ClusterDirectoryNode()])
    async with open_client([Endpoint("127.0.0.1", port)], _node_context(cluster)) as client:
        # The caller's Trio deadline travels as grpc-timeout.
        with trio.move_on_after(3600):
            async with client.stream(WATCH, one) as s:
                async for _ in s:
                    break
        timeout = state.watch_timeouts[-1]
        assert timeout is not None and 3500 < wire.decode_timeout(timeout) <= 3600
        # The server enforces a grpc-timeout on its own (Go clients send one
        # without cancelling locally at the same instant).
        with pytest.raises(RPCError) as e:
            async with client.stream(WATCH, one, metadata={"grpc-timeout": "200m"}) as s:
                async for _ in s:
                    pass
        assert e.value.code is Status.DEADLINE_EXCEEDED
    assert state.watch_timeouts == [timeout, "200m"]
    assert state.watch_cancelled.is_set()


async def test_bidirectional_stream_echoes_until_the_caller_is_done(
    cluster: Cluster, server: tuple[int, State]
) -> None:
    port, state = server
    async with (
        open_client([Endpoint("127.0.0.1", port)], _node_context(cluster)) as client,
        client.bidi(ECHO) as call,
    ):
        got = []
        for i in range(3):
            await call.send(_who(bytes([i]) * 32))
            reply = await call.__anext__()
            got.append((reply.nodes[0].public_key, reply.nodes[1].public_key[0]))
        await call.done_sending()
        assert [m async for m in call] == []  # ends with OK
    assert got == [(cluster.node.public_key, i) for i in range(3)]
    assert state.calls == [ECHO.path]


async def test_bidirectional_stream_checks_access_first_and_cancels_cleanly(
    cluster: Cluster, server: tuple[int, State]
) -> None:
    port, state = server
    # No certificate: refused before the handler runs.
    async with open_client([Endpoint("127.0.0.1", port)], client_context(cluster.ca)) as client:
        with pytest.raises(RPCError) as e:
            async with client.bidi(ECHO) as call:
                await call.send(ClusterDirectory())
                await call.__anext__()
        assert e.value.code is Status.UNAUTHENTICATED
    assert state.calls == []
    # A proof of possession for a client stream covers the empty request.
    key = pki.generate_key()
    async with (
        open_client(
            [Endpoint("127.0.0.1", port)], client_context(cluster.ca), proof_key=key
        ) as client,
        client.bidi(ECHO_PROOF) as call,
    ):
        await call.send(ClusterDirectory())
        assert (await call.__anext__()).nodes[0].public_key == pki.public_key_bytes(key)
        # Leaving the block mid-stream cancels the handler.
    with trio.fail_after(30):
        await state.echo_cancelled.wait()
    assert state.calls == [ECHO_PROOF.path]


# --- the wire, checked by Google's gRPC runtime ------------------------------------------
#
# Where grpcio verifies a handshake signature, the peer holds an ECDSA
# certificate (see tests.fixtures.rpc for why).


def _grpcio_channel(cluster: Cluster, port: int, creds: identity.NodeCredentials) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.encode_certificate(cluster.ca),
        private_key=pki.encode_private_key(creds.private_key),
        certificate_chain=pki.encode_certificate(creds.certificate),
    )
    return grpc.secure_channel(f"127.0.0.1:{port}", credentials)


def _identity(b: bytes) -> bytes:
    return b


@pytest.fixture
async def ecdsa_server(cluster: Cluster) -> AsyncIterator[tuple[int, State]]:
    """The test service with an ECDSA server certificate, for grpcio clients."""
    state = State(owner=pki.public_key_bytes(cluster.owner_key))
    cert, key = ecdsa_leaf(cluster, "ecdsa server")
    context = server_context_for(cert, key, cluster.ca)
    async with running_server(cluster, state, context) as port:
        yield port, state


async def test_grpcio_client_calls_our_server(
    cluster: Cluster, ecdsa_server: tuple[int, State]
) -> None:
    """Google's client, with an Ed25519 node certificate, against our server."""
    port, state = ecdsa_server

    def call() -> tuple[
        bytes,
        list[bytes],
        tuple[grpc.StatusCode, str],
        grpc.StatusCode,
        grpc.StatusCode,
        list[bytes],
    ]:
        with _grpcio_channel(cluster, port, cluster.node) as channel:
            unary = channel.unary_unary(
                WHO_NODE.path, request_serializer=_identity, response_deserializer=_identity
            )
            reply = unary(bytes(_who(b"g" * 32)), timeout=30)
            stream = channel.unary_stream(
                WATCH.path, request_serializer=_identity, response_deserializer=_identity
            )
            streamed = list(stream(bytes(ClusterDirectory(nodes=[ClusterDirectoryNode()] * 3))))
            fail = channel.unary_unary(
                FAIL.path, request_serializer=_identity, response_deserializer=_identity
            )
            try:
                fail(bytes(_who(b"f" * 32)), timeout=30)
                raise AssertionError("FAIL did not fail")
            except grpc.RpcError as e:
                failed = (e.code(), e.details())
            echo = channel.stream_stream(
                ECHO.path, request_serializer=_identity, response_deserializer=_identity
            )
            echoed = list(echo(iter([bytes(_who(bytes([i]) * 32)) for i in range(3)]), timeout=30))
            try:
                unary(bytes(_who(b"o" * (5 << 20))), timeout=30)
                raise AssertionError("an oversized request was taken")
            except grpc.RpcError as e:
                oversized = e.code()
            owner = channel.unary_unary(
                WHO_OWNER.path, request_serializer=_identity, response_deserializer=_identity
            )
            try:
                owner(b"", timeout=30)
                raise AssertionError("a node called an owner method")
            except grpc.RpcError as e:
                denied = e.code()
            return reply, streamed, failed, denied, oversized, echoed

    reply, streamed, failed, denied, oversized, echoed = await trio.to_thread.run_sync(call)
    parsed = ClusterDirectory.parse(reply)
    assert parsed.nodes[0].public_key == cluster.node.public_key
    assert parsed.nodes[1].public_key == b"g" * 32
    assert [ClusterDirectory.parse(m).nodes[0].public_key[0] for m in streamed] == [0, 1, 2]
    assert failed == (grpc.StatusCode.NOT_FOUND, "no such node: ünïcode % ok")
    assert denied == grpc.StatusCode.PERMISSION_DENIED
    assert oversized == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [ClusterDirectory.parse(m).nodes[1].public_key[0] for m in echoed] == [0, 1, 2]
    assert state.calls == [WHO_NODE.path, WATCH.path, FAIL.path, ECHO.path]


async def test_our_client_calls_a_grpcio_server(cluster: Cluster) -> None:
    """Our client against Google's server (Ed25519 server certificate), mutual TLS."""
    from concurrent import futures

    seen: list[bytes] = []

    def who(request: bytes, context: grpc.ServicerContext) -> bytes:
        der = context.auth_context().get("x509_pem_cert", [b""])[0]
        seen.append(der)
        if ClusterDirectory.parse(request).nodes:
            context.abort(grpc.StatusCode.NOT_FOUND, "nope ü")
        return bytes(_who(b"s" * 32))

    def watch(request: bytes, context: grpc.ServicerContext) -> object:
        for i in range(3):
            yield bytes(_who(bytes([i]) * 32))

    handler = grpc.method_handlers_generic_handler(
        "test.Test",
        {
            "WhoNode": grpc.unary_unary_rpc_method_handler(
                who, request_deserializer=_identity, response_serializer=_identity
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                watch, request_deserializer=_identity, response_serializer=_identity
            ),
        },
    )
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    grpc_server.add_generic_rpc_handlers((handler,))
    credentials = grpc.ssl_server_credentials(
        [
            (
                pki.encode_private_key(cluster.server.private_key),
                pki.encode_certificate(cluster.server.certificate),
            )
        ],
        root_certificates=pki.encode_certificate(cluster.ca),
        require_client_auth=True,
    )
    port = grpc_server.add_secure_port("127.0.0.1:0", credentials)
    grpc_server.start()
    client_cert, client_key = ecdsa_leaf(cluster, "ecdsa client")
    try:
        endpoints = [Endpoint("127.0.0.1", port, cluster.server.public_key)]
        context = client_context(cluster.ca, client_cert, client_key)
        async with open_client(endpoints, context) as client:
            got = await client.unary(WHO_NODE, ClusterDirectory())
            assert got.nodes[0].public_key == b"s" * 32
            with pytest.raises(RPCError) as e:
                await client.unary(WHO_NODE, _who(b"q" * 32))
            assert e.value.code is Status.NOT_FOUND
            assert e.value.message == "nope ü"
            async with client.stream(WATCH, ClusterDirectory()) as s:
                assert [m.nodes[0].public_key[0] async for m in s] == [0, 1, 2]
    finally:
        await trio.to_thread.run_sync(lambda: grpc_server.stop(None).wait())
    assert pki.decode_certificate(seen[0]) == client_cert


# --- a curator that vanishes without closing, and the cluster directory ------------------


@asynccontextmanager
async def freezable_proxy(target_port: int) -> AsyncIterator[tuple[int, trio.Event]]:
    """A TCP proxy to ``target_port``; setting the event makes it drop all bytes, silently.

    That is what a partitioned or powered-off peer looks like: no FIN, no RST.
    """
    frozen = trio.Event()

    async def pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
        while data := await source.receive_some(65536):
            if not frozen.is_set():
                await sink.send_all(data)

    async def handle(client: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream("127.0.0.1", target_port)
        async with client, upstream, trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, upstream)
            nursery.start_soon(pump, upstream, client)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handle, 0)
        yield listeners[0].socket.getsockname()[1], frozen
        nursery.cancel_scope.cancel()


async def test_a_silent_curator_is_detected_by_keepalive(
    cluster: Cluster, server: tuple[int, State]
) -> None:
    port, state = server
    one = ClusterDirectory(nodes=[ClusterDirectoryNode()])
    async with freezable_proxy(port) as (proxy_port, frozen):
        endpoints = [Endpoint("127.0.0.1", proxy_port)]
        async with open_client(endpoints, _node_context(cluster), keepalive=(0.1, 0.5)) as client:
            with pytest.raises(RPCError) as e, trio.fail_after(60):
                async with client.stream(WATCH, one) as s:
                    async for _ in s:
                        frozen.set()
            assert e.value.code is Status.UNAVAILABLE
    assert state.watch_sent == 1


def test_endpoints_come_from_the_cluster_directory() -> None:
    a, b = b"a" * 32, b"b" * 32
    directory = ClusterDirectory(
        nodes=[
            ClusterDirectoryNode(
                public_key=a,
                addresses=[
                    ClusterDirectoryNodeAddress(host="10.0.0.1"),
                    ClusterDirectoryNodeAddress(host="fd00::1"),
                ],
            ),
            ClusterDirectoryNode(public_key=b, addresses=[ClusterDirectoryNodeAddress("10.0.0.2")]),
        ]
    )
    assert endpoints_from_directory(directory) == [
        Endpoint("10.0.0.1", CURATOR_PORT, a),
        Endpoint("fd00::1", CURATOR_PORT, a),
        Endpoint("10.0.0.2", CURATOR_PORT, b),
    ]
    assert endpoints_from_directory(directory, 1234)[0].port == 1234


def test_directory_entries_without_a_key_are_reached_by_address() -> None:
    """A learnt entry (no key) must not be held to the empty key: that refused
    every curator it names ("curator's key is not the one the directory lists")."""
    directory = ClusterDirectory(
        nodes=[ClusterDirectoryNode(addresses=[ClusterDirectoryNodeAddress("10.0.0.3")])]
    )
    assert endpoints_from_directory(directory) == [Endpoint("10.0.0.3", CURATOR_PORT, None)]


def test_owner_by_name_only_where_the_owner_key_is_unknown() -> None:
    """A node's debug service knows no owner key: the CA's "owner" certificate is the owner.

    Curators know the key and keep checking it; nothing else passes as owner.
    """
    cluster = Cluster.new()
    owner_key = pki.public_key_bytes(cluster.owner_key)
    other_key = pki.generate_key()
    named_owner = pki.issue_certificate(
        cluster.ca_key, cluster.ca, other_key.public_key(), "owner", pki.Usage.CLIENT
    )
    named_other = pki.issue_certificate(
        cluster.ca_key, cluster.ca, other_key.public_key(), "operator", pki.Usage.CLIENT
    )

    def kind(
        certificate: x509.Certificate, known: bytes | None, by_name: bool
    ) -> auth.PeerKind | Status:
        security = ServerSecurity(
            owner_key=lambda: known,
            crl=lambda: None,
            leadership=lambda: Leadership(True),
            owner_by_name=by_name,
        )
        try:
            peer = auth.authenticate(
                Access.OWNER, WHO_OWNER.path, certificate, {}, b"", security, auth.ReplayCache()
            )
        except RPCError as e:
            return e.code
        return peer.kind

    owner, node = auth.PeerKind.OWNER, cluster.node.certificate
    # Node debug service: no key known, owner by name.
    assert kind(cluster.owner_cert, None, True) is owner
    assert kind(named_owner, None, True) is owner
    assert kind(named_other, None, True) is Status.UNAUTHENTICATED
    assert kind(node, None, True) is Status.PERMISSION_DENIED
    # Curator: the key decides, the name does not.
    assert kind(cluster.owner_cert, owner_key, False) is owner
    assert kind(named_owner, owner_key, False) is Status.UNAUTHENTICATED
    assert kind(named_owner, owner_key, True) is Status.UNAUTHENTICATED
    assert kind(named_owner, None, False) is Status.UNAUTHENTICATED
