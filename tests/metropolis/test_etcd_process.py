"""run_etcd: readiness, logs into the logger, stale sockets, and no orphaned etcd."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from common.net import free_loopback_port
from metropolis.consensus import process
from metropolis.consensus.client import Client, EtcdError
from metropolis.consensus.localetcd import LOOPBACK_TUNING, etcd_pid, kill_etcd
from metropolis.consensus.process import EtcdExited, ProcessConfig, run_etcd
from tests.fixtures.etcd import solo_config

BOUND = 20


async def test_ready_then_cancel_leaves_no_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A socket file left behind by a killed etcd would make etcd fail to bind.
    config = solo_config(tmp_path, stale_socket=True)
    logger = logging.getLogger("test.consensus.etcd")

    with caplog.at_level(logging.INFO, logger=logger.name), trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_etcd, config, logger)
            async with Client(config.socket_path) as client:
                await client.put("k", "v")
            assert etcd_pid(config.working_dir) is not None
            nursery.cancel_scope.cancel()
    # Cancellation returned only after the process was gone.
    assert etcd_pid(config.working_dir) is None
    # etcd's own log lines arrived as records of our logger, at their own levels.
    ours = [r for r in caplog.records if r.name == logger.name]
    assert any("became leader" in r.getMessage() and r.levelno == logging.INFO for r in ours)
    assert any(
        "not cryptographically signed" in r.getMessage() and r.levelno == logging.WARNING
        for r in ours
    )


async def test_server_started_is_told_before_etcd_can_answer(tmp_path: Path) -> None:
    """Told at etcd's own log line: a member whose peer never comes never answers."""
    config = solo_config(tmp_path)
    absent = f"https://127.0.0.1:{free_loopback_port()}"
    config = dataclasses.replace(
        config, initial_cluster={**config.initial_cluster, "absent": absent}
    )
    started = trio.Event()
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: run_etcd(config, logging.getLogger("test"), server_started=started)
            )
            await started.wait()
            # No quorum: etcd runs its server but cannot answer.
            with pytest.raises(EtcdError):
                async with Client(config.socket_path, timeout=0.5) as client:
                    await client.status()
            nursery.cancel_scope.cancel()
    assert etcd_pid(config.working_dir) is None


async def test_crash_raises_etcd_exited(tmp_path: Path) -> None:
    config = solo_config(tmp_path)
    with trio.fail_after(BOUND), pytest.RaisesGroup(EtcdExited):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_etcd, config, logging.getLogger("test"))
            kill_etcd(config.working_dir)
    assert etcd_pid(config.working_dir) is None


async def test_bad_configuration_fails_before_ready(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = solo_config(tmp_path, misnamed=True)
    with trio.fail_after(BOUND), pytest.raises(EtcdExited):
        await run_etcd(config, logging.getLogger("test.bad"))
    # The reason is in the log, not lost with the process.
    assert "couldn't find local name" in caplog.text


_OWNER = """
import logging, sys, trio
from pathlib import Path
from metropolis.consensus.process import ProcessConfig, Tuning, run_etcd

# Trio ends a worker thread after it idled this long (10 s by default): the
# thread that spawned etcd ends within half a second of it, not ten.
trio._core._thread_cache.IDLE_TIMEOUT = 0.5

async def main() -> None:
    config = ProcessConfig.standalone("solo", Path(sys.argv[1]), int(sys.argv[2]), Tuning(20, 200))
    async with trio.open_nursery() as nursery:
        await nursery.start(run_etcd, config, logging.getLogger("owner"))
        print("ready", flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def test_etcd_dies_with_its_owner_even_on_sigkill(tmp_path: Path) -> None:
    """No orphan: SIGKILL of the owning process takes etcd along (PR_SET_PDEATHSIG).

    etcd must also survive the owner's idle Trio worker threads ending
    (after 10 s; the owner here makes it half a second): the death signal
    follows the thread that spawned it.
    """
    config = solo_config(tmp_path)
    owner = await trio.lowlevel.open_process(
        [sys.executable, "-c", _OWNER, str(tmp_path), str(config.peer_address.split(":")[1])],
        stdout=subprocess.PIPE,
    )
    try:
        assert owner.stdout is not None
        with trio.fail_after(BOUND):
            assert b"ready" in await owner.stdout.receive_some()
        pid = etcd_pid(config.working_dir)
        assert pid is not None
        # The worker thread that spawned etcd ends: the owner is down to its main thread.
        with trio.fail_after(BOUND):
            await _eventually(lambda: len(os.listdir(f"/proc/{owner.pid}/task")) == 1)
        await trio.sleep(1.0)  # room for a death signal to land
        assert etcd_pid(config.working_dir) == pid
        owner.send_signal(signal.SIGKILL)
        await owner.wait()
        with trio.fail_after(BOUND):
            await _eventually(lambda: etcd_pid(config.working_dir) is None)
    finally:
        with trio.CancelScope(shield=True):
            owner.kill()
            await owner.wait()
            leftover = etcd_pid(config.working_dir)
            if leftover is not None:
                os.kill(leftover, signal.SIGKILL)


async def _eventually(predicate: Callable[[], bool]) -> None:
    """Poll ``predicate`` until it holds (callers bound the wait)."""
    while True:
        if predicate():
            return
        await trio.sleep(0.05)


def test_lines_below_the_loggers_level_are_not_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Info lines a quiet logger would drop cost no JSON decoding; fatal ones still count,
    and the server-started line is still recognised."""
    decoded: list[str] = []
    real_loads = json.loads

    def counting_loads(text: str) -> object:
        decoded.append(text)
        return real_loads(text)

    monkeypatch.setattr(json, "loads", counting_loads)
    logger = logging.getLogger("test.etcd.quiet")
    logger.setLevel(logging.WARNING)
    fatal: list[str] = []
    info = b'{"level":"info","ts":1.0,"msg":"added member","peer":"x"}'
    assert process._log_line(info, logger, fatal) == ""
    started = b'{"level":"info","ts":1.0,"msg":"now serving peer/client/metrics","x":"y"}'
    assert process._log_line(started, logger, fatal) == process._SERVER_STARTED
    assert decoded == []
    process._log_line(b'{"level":"fatal","ts":1.0,"msg":"cannot start"}', logger, fatal)
    assert fatal == ["cannot start"]

    logger.setLevel(logging.INFO)
    assert process._log_line(info, logger, fatal) == "added member"
    assert len(decoded) == 2  # the fatal line, and the info line once it is logged


@pytest.mark.parametrize("level", [logging.WARNING, logging.INFO])
async def test_marked_lines_call_their_hooks_at_any_log_level(level: int) -> None:
    """Each line saying etcd started, applied a promotion or saw a peer come up calls
    its hook, decoded or not; also when the line arrives in pieces."""
    logger = logging.getLogger("test.etcd.markers")
    logger.setLevel(level)
    seen: list[str] = []
    send, receive = trio.testing.memory_stream_one_way_pair()
    lines = [
        b'{"level":"info","ts":1.0,"msg":"added member","peer":"x"}',
        b'{"level":"info","ts":1.0,"msg":"promote member","cluster-id":"c"}',
        b'{"level":"info","ts":1.0,"msg":"now serving peer/client/metrics"}',
        b'{"level":"info","ts":1.0,"msg":"peer became active","peer-id":"8e9e"}',
        b'{"level":"info","ts":1.0,"msg":"promote member","cluster-id":"c"}',
    ]
    data = b"\n".join(lines) + b"\n"
    hooks: dict[str, Callable[[], None]] = {
        marker: partial(seen.append, marker)
        for marker in (process._SERVER_STARTED, process._PROMOTED, process._PEER_ACTIVE)
    }
    async with trio.open_nursery() as nursery:
        fatal: list[str] = []
        nursery.start_soon(process._pump_logs, receive, logger, fatal, hooks)
        for piece in (data[:70], data[70:150], data[150:250], data[250:]):
            await send.send_all(piece)
        await send.aclose()
    assert seen == [
        process._PROMOTED,
        process._SERVER_STARTED,
        process._PEER_ACTIVE,
        process._PROMOTED,
    ]


@pytest.mark.parametrize("wait", [True, False])
def test_the_member_health_wait_is_passed_to_etcd(tmp_path: Path, wait: bool) -> None:
    tuning = dataclasses.replace(LOOPBACK_TUNING, member_health_wait=wait)
    argv = ProcessConfig.standalone("solo", tmp_path, 1234, tuning).argv()
    assert f"--strict-reconfig-check={'true' if wait else 'false'}" in argv
    # etcd's own default unless told otherwise.
    assert (
        "--strict-reconfig-check=true"
        in ProcessConfig.standalone("solo", tmp_path, 1234, process.Tuning()).argv()
    )
