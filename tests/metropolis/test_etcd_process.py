"""run_etcd: readiness, logs into the logger, stale sockets, and no orphaned etcd."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import trio

from metropolis.consensus.client import Client
from metropolis.consensus.localetcd import LOOPBACK_TUNING, etcd_pid, kill_etcd
from metropolis.consensus.process import EtcdExited, ProcessConfig, run_etcd
from monotrio.net import free_loopback_port

BOUND = 20


def _config(tmp_path: Path) -> ProcessConfig:
    return ProcessConfig.standalone("solo", tmp_path, free_loopback_port(), LOOPBACK_TUNING)


async def test_ready_then_cancel_leaves_no_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    # A socket file left behind by a killed etcd would make etcd fail to bind.
    config.working_dir.mkdir(parents=True)
    config.socket_path.write_bytes(b"")
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


async def test_crash_raises_etcd_exited(tmp_path: Path) -> None:
    config = _config(tmp_path)
    with trio.fail_after(BOUND), pytest.RaisesGroup(EtcdExited):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_etcd, config, logging.getLogger("test"))
            kill_etcd(config.working_dir)
    assert etcd_pid(config.working_dir) is None


async def test_bad_configuration_fails_before_ready(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = dataclasses.replace(
        _config(tmp_path), initial_cluster={"someone-else": "https://127.0.0.1:1"}
    )
    with trio.fail_after(BOUND), pytest.raises(EtcdExited):
        await run_etcd(config, logging.getLogger("test.bad"))
    # The reason is in the log, not lost with the process.
    assert "couldn't find local name" in caplog.text
