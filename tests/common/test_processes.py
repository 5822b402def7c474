"""common.processes.terminate: polite first, sure in the end, never cancelled half-way."""

from __future__ import annotations

import signal
import subprocess
import sys

import trio

from common.processes import terminate

_IGNORE_TERM = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)"


async def _start(code: str) -> trio.Process:
    """A Python child running ``code``, returned once it said it is ready
    (its SIGTERM handler, if any, in place)."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", code + "; print('ready', flush=True); import time; time.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None
    said = b""
    while b"ready" not in said:
        chunk = await process.stdout.receive_some()
        assert chunk, "the child ended before it was ready"
        said += chunk
    return process


async def test_a_process_that_heeds_sigterm_ends_by_it() -> None:
    process = await _start("pass")
    await terminate(process, grace=30)
    assert process.returncode == -signal.SIGTERM


async def test_a_process_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    process = await _start(_IGNORE_TERM)
    await terminate(process, grace=0.5)
    assert process.returncode == -signal.SIGKILL


async def test_a_cancelled_caller_still_waits_until_the_process_is_gone() -> None:
    process = await _start(_IGNORE_TERM)
    with trio.CancelScope() as scope:
        scope.cancel()
        await terminate(process, grace=0.5)
    assert process.returncode == -signal.SIGKILL


async def test_an_exited_process_is_left_as_it_is() -> None:
    process = await trio.lowlevel.open_process([sys.executable, "-c", "pass"])
    await process.wait()
    await terminate(process, grace=30)
    assert process.returncode == 0
