"""Stopping a child process politely, then for sure."""

from __future__ import annotations

import signal

import trio

__all__ = ["terminate"]


async def terminate(process: trio.Process, grace: float) -> None:
    """SIGTERM ``process``, wait up to ``grace`` seconds, then SIGKILL it and reap it.

    Shielded: a cancelled caller still waits until the process is gone, so
    no child outlives the scope that started it. Returns at once for a
    process that already exited.
    """
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(grace):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
