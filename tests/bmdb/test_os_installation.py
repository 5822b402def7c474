"""The OS installation tags: requests only move forward, reports only land
on the requested generation, and what is stored is what the views read."""

from __future__ import annotations

import uuid

import pytest

import bmdb
from bmdb import overview
from bmdb.errors import InvalidArgument
from bmdb.model import InstallState, OSInstallation, Queries, node_id
from tests.bmdb.helpers import add_provided_machines

KEY = bytes(range(32))


async def _request(q: Queries, machine_id: uuid.UUID, generation: int) -> bool:
    return await q.set_os_installation_request(
        machine_id,
        generation,
        f"request {generation}".encode(),
        root_device="vda",
        image_digest="sha256:" + "ab" * 32,
        node_address="127.0.0.2",
    )


async def _installation(conn: bmdb.Connection, machine_id: uuid.UUID) -> OSInstallation | None:
    async def fn(q: Queries) -> OSInstallation | None:
        return await q.os_installation(machine_id)

    return await conn.transact(fn)


async def test_requests_only_move_forward(bmdb_conn: bmdb.Connection) -> None:
    [mid] = await add_provided_machines(bmdb_conn, 1)
    assert await _installation(bmdb_conn, mid) is None

    async def fn(q: Queries) -> list[bool]:
        return [await _request(q, mid, 1), await _request(q, mid, 3), await _request(q, mid, 2)]

    assert await bmdb_conn.transact(fn) == [True, True, False]
    got = await _installation(bmdb_conn, mid)
    assert got is not None
    assert (got.generation, got.root_device, got.node_address) == (3, "vda", "127.0.0.2")
    assert got.image_digest == "sha256:" + "ab" * 32
    assert got.state is InstallState.INSTALLING and got.node_id is None


async def test_report_lands_only_on_the_requested_generation(bmdb_conn: bmdb.Connection) -> None:
    [mid, other] = await add_provided_machines(bmdb_conn, 2)

    async def fn(q: Queries) -> list[bool]:
        await _request(q, mid, 2)
        return [
            await q.record_os_installation_report(mid, 1, b"old", True, None, KEY),
            await q.record_os_installation_report(mid, 3, b"new", True, None, KEY),
            # No request at all on this machine.
            await q.record_os_installation_report(other, 1, b"x", True, None, KEY),
            await q.record_os_installation_report(mid, 2, b"err", False, "disk full", None),
        ]

    assert await bmdb_conn.transact(fn) == [False, False, False, True]
    got = await _installation(bmdb_conn, mid)
    assert got is not None
    assert got.state is InstallState.INSTALL_FAILED and got.cause == "disk full"
    assert await _installation(bmdb_conn, other) is None

    async def succeed(q: Queries) -> bool:
        return await q.record_os_installation_report(mid, 2, b"ok", True, None, KEY)

    assert await bmdb_conn.transact(succeed)
    got = await _installation(bmdb_conn, mid)
    assert got is not None
    assert (got.state, got.cause, got.report_generation) == (InstallState.INSTALLED, None, 2)
    assert got.node_id == "metropolis-" + KEY[:16].hex()

    # A new request: installing again, the old report stays as it was.
    async def again(q: Queries) -> bool:
        return await _request(q, mid, 3)

    assert await bmdb_conn.transact(again)
    got = await _installation(bmdb_conn, mid)
    assert got is not None and got.state is InstallState.INSTALLING
    assert got.report_generation == 2 and got.node_id is None


def test_node_id_is_metropolis_s() -> None:
    from metropolis import identity

    assert node_id(KEY) == identity.node_id(KEY)


@pytest.mark.parametrize(
    ("success", "cause", "key", "why"),
    [
        (True, "oops", None, "no cause"),
        (False, None, None, "needs a cause"),
        (False, "x", KEY, "no node public key"),
        (True, None, b"short", "want 32"),
        (False, "a\x00b", None, "NUL"),
        (False, "x" * 5000, None, "over 4096"),
    ],
)
async def test_malformed_reports_are_refused(
    bmdb_conn: bmdb.Connection, success: bool, cause: str | None, key: bytes | None, why: str
) -> None:
    [mid] = await add_provided_machines(bmdb_conn, 1)

    async def fn(q: Queries) -> bool:
        await _request(q, mid, 1)
        return await q.record_os_installation_report(mid, 1, b"r", success, cause, key)

    with pytest.raises(InvalidArgument, match=why):
        await bmdb_conn.transact(fn)
    # Rolled back: not even the request.
    assert await _installation(bmdb_conn, mid) is None


async def test_bad_requests_are_refused(bmdb_conn: bmdb.Connection) -> None:
    [mid] = await add_provided_machines(bmdb_conn, 1)
    for generation, device in ((0, "vda"), (1, "v\x00da")):

        async def fn(q: Queries, g: int = generation, d: str = device) -> bool:
            return await q.set_os_installation_request(
                mid, g, b"r", root_device=d, image_digest="sha256:00", node_address=None
            )

        with pytest.raises(InvalidArgument):
            await bmdb_conn.transact(fn)
    assert await _installation(bmdb_conn, mid) is None


async def test_raw_only_rows_show_as_installing(bmdb_conn: bmdb.Connection) -> None:
    """A request without its fields and a report without its outcome (raw
    bytes only, as tools and rows from before migration 0003 have them) say
    nothing the views could show: installing, fields unknown."""
    [mid] = await add_provided_machines(bmdb_conn, 1)

    async def fn(q: Queries) -> None:
        await q.set_os_installation_request(mid, 1, b"req")
        await q.set_os_installation_report(mid, 1, b"raw report")

    await bmdb_conn.transact(fn)
    got = await _installation(bmdb_conn, mid)
    assert got is not None
    assert (got.generation, got.root_device, got.report_generation) == (1, None, 1)
    assert got.state is InstallState.INSTALLING and not got.reported


async def test_a_check_lands_only_on_an_installed_current_generation_of_the_same_key(
    bmdb_conn: bmdb.Connection,
) -> None:
    """What an agent finds of its install later (migration 0010): stored
    beside a success of the current generation and the same node key only."""
    [mid, failed] = await add_provided_machines(bmdb_conn, 2)
    other = bytes(range(1, 33))

    async def setup(q: Queries) -> None:
        await _request(q, mid, 1)
        await q.record_os_installation_report(mid, 1, b"ok", True, None, KEY)
        await _request(q, failed, 1)
        await q.record_os_installation_report(failed, 1, b"err", False, "disk full", None)

    await bmdb_conn.transact(setup)

    async def checks(q: Queries) -> list[bool]:
        return [
            await q.record_installation_check(mid, 2, KEY, None),  # not its generation
            await q.record_installation_check(mid, 1, other, None),  # another node's key
            await q.record_installation_check(failed, 1, KEY, None),  # a failed install
            await q.record_installation_check(failed, 1, None, "gone"),
            await q.record_installation_check(mid, 1, KEY, None),  # still there
        ]

    assert await bmdb_conn.transact(checks) == [False, False, False, False, True]
    got = await _installation(bmdb_conn, mid)
    assert got is not None and got.state is InstallState.INSTALLED and got.checked_at is not None
    assert (await _installation(bmdb_conn, failed)).state is InstallState.INSTALL_FAILED  # type: ignore[union-attr]

    async def lost(q: Queries) -> bool:
        return await q.record_installation_check(mid, 1, None, "gone from /dev/sdb: no record")

    assert await bmdb_conn.transact(lost)
    got = await _installation(bmdb_conn, mid)
    assert got is not None and got.state is InstallState.INSTALL_LOST
    assert got.lost_cause == "gone from /dev/sdb: no record"
    assert got.node_public_key == KEY  # the node is still known: a decommission removes it
    listed = await overview.machines(bmdb_conn, state="install-lost")
    assert [m.machine_id for m in listed] == [mid]
    assert listed[0].install_cause == "gone from /dev/sdb: no record"

    # Found again: installed. A new request's report clears what a check said.
    async def found(q: Queries) -> bool:
        return await q.record_installation_check(mid, 1, KEY, None)

    assert await bmdb_conn.transact(found)
    assert (await _installation(bmdb_conn, mid)).state is InstallState.INSTALLED  # type: ignore[union-attr]
    await bmdb_conn.transact(lost)

    async def again(q: Queries) -> bool:
        await _request(q, mid, 2)
        return await q.record_os_installation_report(mid, 2, b"ok", True, None, other)

    assert await bmdb_conn.transact(again)
    got = await _installation(bmdb_conn, mid)
    assert got is not None and got.state is InstallState.INSTALLED
    assert (got.lost_cause, got.checked_at) == (None, None)


@pytest.mark.parametrize(
    ("key", "cause", "why"),
    [(None, None, "not both"), (KEY, "x", "not both"), (b"short", None, "want 32"),
     (None, "a\x00b", "NUL")],
)  # fmt: skip
async def test_malformed_checks_are_refused(
    bmdb_conn: bmdb.Connection, key: bytes | None, cause: str | None, why: str
) -> None:
    [mid] = await add_provided_machines(bmdb_conn, 1)

    async def fn(q: Queries) -> bool:
        return await q.record_installation_check(mid, 1, key, cause)

    with pytest.raises(InvalidArgument, match=why):
        await bmdb_conn.transact(fn)
