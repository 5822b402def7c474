"""An etcd started ahead (`metropolis.consensus.child`): taken over by the
run_etcd of its command line only, stopped otherwise, never left running."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from metropolis.consensus import child
from metropolis.consensus.client import Client
from metropolis.consensus.localetcd import LOOPBACK_TUNING, etcd_pid
from metropolis.consensus.process import EtcdExited, run_etcd
from tests.fixtures.etcd import solo_config

BOUND = 20


@pytest.fixture(autouse=True)
def _none_left() -> Iterator[None]:
    """Whatever a test leaves ahead is stopped; each test starts with none."""
    assert child._ahead is None
    yield
    child.stop_ahead()


async def test_run_etcd_of_the_same_command_line_takes_it_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A socket file left behind by a killed etcd is removed here too.
    config = solo_config(tmp_path, stale_socket=True)
    pid = child.start_ahead(config)
    with pytest.raises(RuntimeError, match="not taken over"):
        child.start_ahead(config)
    logger = logging.getLogger("test.ahead.etcd")
    with caplog.at_level(logging.INFO), trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_etcd, config, logger)
            assert etcd_pid(config.working_dir) == pid
            async with Client(config.socket_path) as client:
                await client.put("k", "v")
            nursery.cancel_scope.cancel()
    assert etcd_pid(config.working_dir) is None
    assert child._ahead is None
    # Its lines from before the takeover reached the owner's logger all the same.
    ours = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert any("taking over etcd started ahead" in m for m in ours)
    assert any("became leader" in m for m in ours)


async def test_another_command_line_stops_it_and_starts_its_own(tmp_path: Path) -> None:
    config = solo_config(tmp_path)
    pid = child.start_ahead(config)
    other = dataclasses.replace(
        config, tuning=dataclasses.replace(LOOPBACK_TUNING, heartbeat_ms=30)
    )
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_etcd, other, logging.getLogger("test.ahead.other"))
            running = etcd_pid(config.working_dir)
            assert running is not None and running != pid
            nursery.cancel_scope.cancel()
    assert etcd_pid(config.working_dir) is None


async def test_one_that_exited_is_taken_over_and_its_reason_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = solo_config(tmp_path, misnamed=True)
    child.start_ahead(config)
    with trio.fail_after(BOUND), pytest.raises(EtcdExited, match="discovery failed"):
        await run_etcd(config, logging.getLogger("test.ahead.bad"))
    assert child._ahead is None
    # Its lines, printed before anyone read them, are in the log.
    assert "couldn't find local name" in caplog.text


def test_stop_ahead_stops_one_not_taken_over(tmp_path: Path) -> None:
    config = solo_config(tmp_path)
    child.stop_ahead()  # none: nothing to do
    pid = child.start_ahead(config)
    # Its pid from the fork on (setpriv, then etcd in its place).
    assert Path(f"/proc/{pid}").exists()
    child.stop_ahead()
    assert not Path(f"/proc/{pid}").exists()  # stopped and reaped
    assert etcd_pid(config.working_dir) is None
    assert child._ahead is None
