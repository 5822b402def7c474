"""``python -m shepherd.agent_server``: options, serving, stopping on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

import bmdb
from common.net import free_loopback_port
from shepherd.agent import protocol
from shepherd.agent_server.__main__ import parse_config


def test_tls_or_explicitly_plain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_config(["--bmdb-url", "postgresql://x/y"])
    assert exited.value.code == 2
    assert "--insecure-plain-http" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(["--bmdb-url", "u", "--tls-certificate-path", str(tmp_path / "c.pem")])
    assert "go together" in capsys.readouterr().err
    url, config, verbose = parse_config(
        ["--bmdb-url", "u", "--insecure-plain-http", "--listen", "127.0.0.1:9", "--freshness", "30"]
    )
    assert (url, config.listen, config.certfile, config.freshness, verbose) == (
        "u",
        "127.0.0.1:9",
        None,
        30.0,
        False,
    )


async def test_serves_and_stops_on_sigterm(bmdb_conn: bmdb.Connection, bmdb_url: str) -> None:
    port = free_loopback_port()
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "shepherd.agent_server",
            "--bmdb-url",
            bmdb_url,
            "--listen",
            f"127.0.0.1:{port}",
            "--insecure-plain-http",
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        async with httpx.AsyncClient() as client:
            with trio.fail_after(120):
                while True:
                    try:
                        response = await client.post(
                            f"http://127.0.0.1:{port}{protocol.HEARTBEAT_PATH}",
                            content=b"",
                            headers={"Content-Type": "application/proto"},
                        )
                        break
                    except httpx.TransportError:
                        await trio.sleep(0.2)
        # An empty request names no machine: the server answers, refusing it.
        assert response.status_code == 400
        assert response.json()["code"] == "invalid_argument"
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def test_a_server_process_collects_cycles_less_often() -> None:
    """`tune_gc` (run by the server's main before it serves), in a process
    of its own: the collector's settings are the process's."""
    code = (
        "import gc\n"
        "from shepherd.agent_server.server import GC_THRESHOLD, tune_gc\n"
        "assert gc.get_freeze_count() == 0 and gc.get_threshold()[0] < GC_THRESHOLD\n"
        "tune_gc()\n"
        "assert gc.get_threshold() == (GC_THRESHOLD, 10, 10), gc.get_threshold()\n"
        "assert gc.get_freeze_count() > 1000, gc.get_freeze_count()\n"
        "cycle = []; cycle.append(cycle); del cycle\n"
        "assert gc.collect() >= 1  # cycles are still freed\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
