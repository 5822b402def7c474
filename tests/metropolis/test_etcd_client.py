"""The trio-native etcd clients against a real etcd on a UNIX socket.

Every test runs with both clients: ``client`` (etcd's JSON gateway) and
``bench.etcdgrpc`` (etcd's native gRPC), which promise the same behaviour.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path

import pytest
import trio

from bench import etcdgrpc as grpcclient
from metropolis.consensus.client import (
    GRPC_FAILED_PRECONDITION,
    GRPC_OUT_OF_RANGE,
    Client,
    Compare,
    Delete,
    DeleteResult,
    EtcdAPIError,
    EtcdClosed,
    EtcdUnavailable,
    Get,
    LeaseExpired,
    Put,
    PutResult,
    RangeResult,
    SocketPathTooLong,
    Watch,
    WatchCompacted,
    WatchResponse,
)
from metropolis.consensus.localetcd import EtcdServer

# Safety bound for anything that waits on etcd; never asserted on.
BOUND = 20


#: Either client: they share records and errors, and promise the same behaviour.
AnyClient = Client | grpcclient.Client
ClientClass = type[Client] | type[grpcclient.Client]


@pytest.fixture(params=["gateway", "grpc"])
def client_class(request: pytest.FixtureRequest) -> ClientClass:
    return Client if request.param == "gateway" else grpcclient.Client


@pytest.fixture
async def client(etcd: EtcdServer, client_class: ClientClass) -> AsyncIterator[AnyClient]:
    async with client_class(etcd.socket_path, timeout=10) as client:
        yield client


async def test_put_get_range_delete(client: AnyClient) -> None:
    assert await client.get("missing") is None
    first = await client.put("dir/a", b"\x00\xff binary")
    await client.put("dir/b", "text")
    await client.put("dir0", "not under dir/")

    kv = await client.get("dir/a")
    assert kv is not None
    assert (kv.key, kv.value, kv.create_revision, kv.version) == (
        b"dir/a",
        b"\x00\xff binary",
        first.revision,
        1,
    )
    listing = await client.range("dir/", prefix=True)
    assert [k.key for k in listing.kvs] == [b"dir/a", b"dir/b"]
    assert listing.count == 2 and not listing.more

    limited = await client.range("dir/", prefix=True, limit=1)
    assert [k.key for k in limited.kvs] == [b"dir/a"] and limited.more and limited.count == 2

    # Reading at an older revision sees the past.
    await client.put("dir/a", "v2")
    old = await client.range("dir/a", revision=first.revision)
    assert old.kvs[0].value == b"\x00\xff binary"

    deleted = await client.delete("dir/", prefix=True)
    assert deleted.deleted == 2
    assert (await client.range("", prefix=True)).count == 1


async def test_txn_create_if_absent_and_cas(client: AnyClient) -> None:
    created = await client.txn([Compare.absent("k")], [Put("k", "one")], [Get("k")])
    assert created.succeeded
    assert isinstance(created.responses[0], PutResult)

    again = await client.txn([Compare.absent("k")], [Put("k", "two")], [Get("k")])
    assert not again.succeeded  # etcd omits "succeeded" here
    existing = again.responses[0]
    assert isinstance(existing, RangeResult)
    assert existing.kvs[0].value == b"one"

    # Optimistic concurrency on the modification revision.
    rev = existing.kvs[0].mod_revision
    await client.put("k", "changed behind our back")
    stale = await client.txn([Compare.mod_revision("k", "==", rev)], [Put("k", "mine")])
    assert not stale.succeeded
    assert (await client.get("k")).value == b"changed behind our back"  # type: ignore[union-attr]

    by_value = await client.txn(
        [Compare.value("k", "==", "changed behind our back"), Compare.version("k", ">", 1)],
        [Delete("k")],
    )
    assert by_value.succeeded
    assert isinstance(by_value.responses[0], DeleteResult)
    assert by_value.responses[0].deleted == 1
    with pytest.raises(ValueError, match="compare op"):
        Compare.value("k", "=", "x")  # type: ignore[arg-type]


async def test_namespaced_view_is_confined(client: AnyClient) -> None:
    await client.put("outside", "x")
    await client.put("ns/", "the bare prefix key")
    ns = client.namespaced("ns/")
    await ns.put("a", "1")
    nested = ns.namespaced("sub/")
    await nested.put("b", "2")

    assert (await client.get("ns/a")).value == b"1"  # type: ignore[union-attr]
    assert (await client.get("ns/sub/b")).value == b"2"  # type: ignore[union-attr]
    assert [k.key for k in (await ns.range("", prefix=True)).kvs] == [b"", b"a", b"sub/b"]
    assert [k.key for k in (await nested.range("", prefix=True)).kvs] == [b"b"]
    assert await ns.get("outside") is None

    txn = await nested.txn([Compare.absent("b")], [], [Get("", prefix=True)])
    assert not txn.succeeded
    assert isinstance(txn.responses[0], RangeResult)
    assert [k.key for k in txn.responses[0].kvs] == [b"b"]

    assert (await ns.delete("", prefix=True)).deleted == 3
    assert (await client.get("outside")) is not None
    with pytest.raises(ValueError):
        ns.namespaced("")


async def test_lease_lifecycle(client: AnyClient) -> None:
    lease = await client.grant(30)
    assert lease.ttl == 30
    await client.put("leased", "v", lease=lease.id)
    assert (await client.get("leased")).lease == lease.id  # type: ignore[union-attr]
    assert 0 < await client.keep_alive_once(lease.id) <= 30

    await client.revoke(lease.id)
    assert await client.get("leased") is None
    with pytest.raises(LeaseExpired):
        await client.keep_alive_once(lease.id)
    with pytest.raises(LeaseExpired):
        await client.revoke(lease.id)
    with pytest.raises(ValueError):
        await client.grant(0)


async def test_keep_alive_outlives_ttl_and_reports_revocation(client: AnyClient) -> None:
    lease = await client.grant(1)
    await client.put("alive", "v", lease=lease.id)
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            await nursery.start(client.keep_alive, lease)
            # Well past the 1 s TTL: only the keep-alive task keeps the key.
            await trio.sleep(2.5)
            assert await client.get("alive") is not None
            nursery.cancel_scope.cancel()

        with pytest.RaisesGroup(LeaseExpired):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.keep_alive, lease)
                await client.revoke(lease.id)


async def test_watch_history_prefix_and_deletes(client: AnyClient) -> None:
    start = (await client.put("w/a", "1")).revision
    await client.put("w/b", "2")
    await client.put("other", "x")
    await client.delete("w/a")
    with trio.fail_after(BOUND):
        async with client.watch("w/", prefix=True, start_revision=start) as watch:
            seen: list[tuple[str, bytes, bytes]] = []
            while len(seen) < 4:
                response = await anext(watch)
                seen += [(e.type, e.kv.key, e.kv.value) for e in response.events]
                if len(seen) == 3:
                    await client.put("w/c", "3")
    assert seen == [
        ("PUT", b"w/a", b"1"),
        ("PUT", b"w/b", b"2"),
        ("DELETE", b"w/a", b""),
        ("PUT", b"w/c", b"3"),
    ]


async def _next_values(watch: Watch | grpcclient.Watch, count: int) -> list[bytes]:
    values: list[bytes] = []
    while len(values) < count:
        response: WatchResponse = await anext(watch)
        values += [e.kv.value for e in response.events]
    return values


@pytest.mark.parametrize("crash", [False, True], ids=["restart", "sigkill"])
async def test_watch_resumes_after_etcd_restart(
    etcd: EtcdServer, client: AnyClient, crash: bool
) -> None:
    with trio.fail_after(BOUND):
        async with client.watch("key") as watch:
            # A watch from "now" is pinned to a revision once created, so
            # changes made while it reconnects are not lost.
            await client.put("key", "before")
            assert await _next_values(watch, 1) == [b"before"]

            await (etcd.kill() if crash else etcd.stop())
            with pytest.raises(EtcdUnavailable):
                await client.put("key", "while down")
            await etcd.start()
            await client.put("key", "after-1")
            await client.put("key", "after-2")
            # Exactly the new changes, once each, in order.
            assert await _next_values(watch, 2) == [b"after-1", b"after-2"]


async def test_unary_calls_survive_an_etcd_restart_between_them(
    etcd: EtcdServer, client: AnyClient
) -> None:
    # The keep-alive connection of the first call is closed by the old etcd;
    # the next call must notice (before sending) and dial the new one.
    with trio.fail_after(BOUND):
        await client.put("k", "before")
        await etcd.stop()
        await etcd.start()
        await client.put("k", "after")
        got = await client.get("k")
    assert got is not None and got.value == b"after"


async def test_large_and_concurrent_unary_answers(client: AnyClient) -> None:
    # etcd's gateway sends bodies over 2 KiB chunked; concurrent calls each
    # get a connection of their own from the pool.
    big = bytes(range(256)) * 400  # 100 KiB, base64 in JSON on the wire
    with trio.fail_after(BOUND):
        await client.put("big", big)
        results: list[bytes] = []

        async def get() -> None:
            kv = await client.get("big")
            assert kv is not None
            results.append(kv.value)

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(get)
    assert results == [big] * 5


async def test_watch_from_compacted_revision(client: AnyClient) -> None:
    first = (await client.put("c", "1")).revision
    latest = (await client.put("c", "2")).revision
    await client.compact(latest)
    with trio.fail_after(BOUND), pytest.raises(WatchCompacted) as info:
        async with client.watch("c", start_revision=first) as watch:
            await anext(watch)
    assert info.value.compact_revision == latest


async def test_watch_outlives_the_call_timeout_and_its_opening_scope(
    etcd: EtcdServer, client_class: ClientClass
) -> None:
    """A watch has no deadline: neither the client's per-call timeout nor a
    deadline around its opening ends it on etcd's side."""
    async with client_class(etcd.socket_path, timeout=0.5) as client:
        with trio.fail_after(0.5):
            watch = await client.watch("late").__aenter__()
        try:
            await trio.sleep(1.5)
            await client.put("late", "v")
            with trio.fail_after(BOUND):
                response = await anext(watch)
            assert [e.kv.value for e in response.events] == [b"v"]
        finally:
            await watch.__aexit__(None, None, None)


async def test_watch_is_cancellable(client: AnyClient) -> None:
    with trio.move_on_after(0.3) as scope:
        async with client.watch("never") as watch:
            await anext(watch)
    assert scope.cancelled_caught


async def test_errors_are_typed(
    client: AnyClient, client_class: ClientClass, tmp_path: Path
) -> None:
    with pytest.raises(EtcdAPIError) as info:
        await client.range("x", revision=10_000)
    assert info.value.code == GRPC_OUT_OF_RANGE
    assert "future revision" in info.value.message

    async with client_class(tmp_path / "no-such.sock:0") as down:
        with pytest.raises(EtcdUnavailable, match=r"no-such\.sock"):
            await down.get("x")
    closed = client_class(client._gw.socket_path)
    await closed.aclose()
    with pytest.raises(EtcdClosed):
        await closed.namespaced("p/").get("x")

    with pytest.raises(SocketPathTooLong, match="109 bytes"):
        client_class(Path("/" + "x" * 108))


async def test_closing_the_client_ends_watches_and_keep_alives(
    client: AnyClient, client_class: ClientClass
) -> None:
    """A watch or keep-alive on a client that goes away raises, instead of retrying forever."""
    watch_error: list[BaseException] = []
    keep_alive_error: list[BaseException] = []
    async with client_class(client._gw.socket_path) as other:
        lease = await other.grant(10)

        async def watch() -> None:
            try:
                async with other.watch("w") as w:
                    async for _ in w:
                        pass
            except EtcdClosed as e:
                watch_error.append(e)

        async def keep_alive() -> None:
            try:
                await other.keep_alive(lease)
            except EtcdClosed as e:
                keep_alive_error.append(e)

        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                nursery.start_soon(keep_alive)
                await trio.sleep(0.3)  # both are connected (or fail the same way if not)
                await other.aclose()
    assert watch_error and keep_alive_error


async def test_members_and_status(client: AnyClient) -> None:
    status = await client.status()
    members = await client.member_list()
    assert [m.id for m in members] == [status.member_id]
    assert status.leader == status.member_id
    assert members[0].name == "test" and not members[0].is_learner
    assert status.version.startswith("3.4")

    learner = await client.member_add(["https://127.0.0.1:1"])
    assert learner.is_learner and learner.name == ""
    assert {m.id for m in await client.member_list()} == {status.member_id, learner.id}
    # A learner that never started cannot be in sync: etcd refuses, transiently.
    with pytest.raises(EtcdAPIError) as info:
        await client.member_promote(learner.id)
    assert info.value.code == GRPC_FAILED_PRECONDITION and info.value.transient

    await client.member_remove(learner.id)
    assert [m.id for m in await client.member_list()] == [status.member_id]


async def test_membership_changes_at_once_are_all_answered(
    etcd: EtcdServer, client_class: ClientClass
) -> None:
    """raft keeps one membership change pending at a time and silently drops
    any other proposed meanwhile; etcd then never answers the dropped one
    unless the request has a deadline. Every change here must get an answer
    (done, or refused transiently) well before the client's own timeout."""
    outcomes: list[str] = []
    async with client_class(etcd.socket_path, timeout=BOUND, membership_deadline=1.0) as client:

        async def change(call: Callable[[], Awaitable[object]]) -> None:
            try:
                await call()
            except EtcdAPIError as e:
                assert e.transient, e
                outcomes.append("refused" if e.code == GRPC_FAILED_PRECONDITION else "timed out")
            else:
                outcomes.append("done")

        # Rounds until raft has dropped a change (most rounds here; fewer
        # on a loaded machine, where the two proposals spread out).
        for port in range(1, 26):
            if "timed out" in outcomes:
                break
            learner = await client.member_add([f"https://127.0.0.2:{port}"])
            # Well below BOUND: without etcd's deadline a dropped change waits
            # for the client's timeout (BOUND), and this fails.
            with trio.fail_after(BOUND / 2):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(change, partial(client.member_remove, learner.id))
                    nursery.start_soon(
                        change, partial(client.member_add, [f"https://127.0.0.3:{port}"])
                    )
            for member in await client.member_list():
                if member.is_learner:
                    await client.member_remove(member.id)
    # The race is real: raft dropped at least one change (nine rounds in ten
    # on a quiet machine); each such change timed out instead of hanging.
    assert "timed out" in outcomes, outcomes


async def test_prefix_ranges_handle_0xff_bytes(client: AnyClient) -> None:
    # The end of the "a\xff" prefix is "b", not "a\x00" (a naive increment).
    for key in (b"a\xff1", b"a\xff\xff", b"b", b"a\xfe"):
        await client.put(key, "v")
    ns = client.namespaced(b"a\xff")
    assert [k.key for k in (await ns.range("", prefix=True)).kvs] == [b"1", b"\xff"]
    all_ff = client.namespaced(b"\xff\xff")
    await all_ff.put("x", "v")
    # No key is above every "\xff\xff..." key: the range runs to the end.
    assert [k.key for k in (await all_ff.range("", prefix=True)).kvs] == [b"x"]


async def _silent_server(path: Path, *, task_status: trio.TaskStatus[None]) -> None:
    """Accept connections on a UNIX socket and never answer (a hung etcd)."""
    listener = trio.socket.socket(trio.socket.AF_UNIX)
    await listener.bind(str(path))
    listener.listen()
    task_status.started()
    accepted = []
    with listener:
        while True:
            connection, _ = await listener.accept()
            accepted.append(connection)  # keep it open, say nothing


async def test_hung_etcd_cancellation_and_timeout(
    tmp_path: Path, client_class: ClientClass
) -> None:
    socket = tmp_path / "hung.sock"
    async with trio.open_nursery() as nursery:
        await nursery.start(_silent_server, socket)

        # Trio cancellation reaches into httpx/anyio: the call gives up at once.
        async with client_class(socket) as client:
            with trio.move_on_after(0.2) as scope:
                await client.get("x")
            assert scope.cancelled_caught

        # Without a cancel scope, the client's own timeout ends the wait.
        async with client_class(socket, timeout=0.2) as client:
            with trio.fail_after(BOUND), pytest.raises(EtcdUnavailable, match="Timeout"):
                await client.get("x")
        nursery.cancel_scope.cancel()


async def test_keep_alive_gives_up_when_etcd_stays_down(
    etcd: EtcdServer, client: AnyClient
) -> None:
    lease = await client.grant(2)
    with trio.fail_after(BOUND), pytest.RaisesGroup(LeaseExpired):
        async with trio.open_nursery() as nursery:
            await nursery.start(client.keep_alive, lease)
            await etcd.stop()
            # keep_alive now retries until a full TTL has passed, then gives up.


async def test_no_transport_error_escapes(tmp_path: Path, client_class: ClientClass) -> None:
    """An answer the transport cannot decode (a gzip body, never asked for;
    for the gRPC client, HTTP/1.1 at all) raises `EtcdUnavailable`, not a
    transport's own error."""
    path = tmp_path / "garbled.sock"
    listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await listener.bind(str(path))
    listener.listen()
    garbled = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Content-Encoding: gzip\r\nContent-Length: 9\r\n\r\nnot gzip!"
    )

    async def serve() -> None:
        while True:
            conn, _ = await listener.accept()
            with conn:
                await conn.recv(65536)
                await conn.send(garbled)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        async with client_class(path, timeout=10) as client:
            why = "Content-Encoding" if client_class is Client else r"garbled\.sock"
            with pytest.raises(EtcdUnavailable, match=why):
                await client.get("k")
        nursery.cancel_scope.cancel()
    listener.close()


async def _gateway_cutting_short(
    path: Path, answers: list[bytes], seen: list[bytes], *, task_status: trio.TaskStatus[None]
) -> None:
    """A UNIX-socket stand-in for etcd's gateway: one request per connection,
    answered with the first of ``answers``, taken off the list unless it is
    the last; each request's head line goes to ``seen``."""
    listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await listener.bind(str(path))
    listener.listen()
    task_status.started()
    with listener:
        while True:
            conn, _ = await listener.accept()
            with conn:
                request = await conn.recv(65536)
                seen.append(request.split(b"\r\n", 1)[0])
                body = answers.pop(0) if len(answers) > 1 else answers[0]
                status = b"200 OK" if b'"kvs"' in body else b"500 Internal Server Error"
                await conn.send(
                    b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
                    b"Connection: close\r\nContent-Length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )


_CUT_SHORT = b'{"error":"unexpected EOF","code":13,"message":"unexpected EOF"}'


async def test_a_read_the_gateway_cut_short_is_sent_again_a_write_is_not(
    tmp_path: Path,
) -> None:
    """etcd 3.4's gateway relays each call over gRPC to its own member, and
    answers INTERNAL "unexpected EOF" when that link loses the answer midway
    (seen on CI under load). A read is sent again; a write, which may have
    been applied, is not."""
    found = (
        b'{"header":{"revision":"7"},"count":"1","kvs":[{"key":"aw==","value":"dg==",'
        b'"create_revision":"7","mod_revision":"7","version":"1"}]}'
    )
    path = tmp_path / "gw.sock"
    seen: list[bytes] = []
    answers = [_CUT_SHORT, _CUT_SHORT, found]
    async with trio.open_nursery() as nursery:
        await nursery.start(_gateway_cutting_short, path, answers, seen)
        async with Client(path, timeout=10) as client:
            with trio.fail_after(BOUND):
                kv = await client.get("k")
            assert kv is not None and kv.value == b"v"
            assert seen == [b"POST /v3/kv/range HTTP/1.1"] * 3

            seen.clear()
            answers[:] = [_CUT_SHORT]
            with trio.fail_after(BOUND), pytest.raises(EtcdAPIError) as info:
                await client.put("k", "v")
            assert info.value.cut_short
            assert seen == [b"POST /v3/kv/put HTTP/1.1"]

            # A read cut short every time gives up after its retries.
            seen.clear()
            with trio.fail_after(BOUND), pytest.raises(EtcdAPIError, match="unexpected EOF"):
                await client.get("k")
            assert len(seen) == 3
        nursery.cancel_scope.cancel()
