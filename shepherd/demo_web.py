"""The demo's web UI: ``python -m console web`` for the run, on the BMDB
and (once there is one) the cluster, its URL logged as a progress line.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import trio

from common.processes import terminate
from shepherd.demo_cluster import DemoFailed
from shepherd.demo_workdir import STOP_GRACE
from shepherd.localcluster import FirstNode

logger = logging.getLogger("shepherd.demo_web")


async def start_web(
    nursery: trio.Nursery,
    listen: str,
    log: Path,
    bmdb_url: str,
    first: FirstNode | None = None,
) -> list[str]:
    """Start ``python -m console web`` at ``listen`` (HOST:PORT) on the BMDB
    at ``bmdb_url`` and, given ``first``, its cluster, in a session of its
    own, its stderr appended to ``log``; log its URL. It runs in ``nursery``
    and stops (SIGTERM, SIGKILL after `STOP_GRACE` s) when that is
    cancelled: the demo cancels it before PostgreSQL stops. `DemoFailed` if
    it does not serve within 60 s. Returns the URLs it serves on."""
    argv = [sys.executable, "-m", "console", "--url", bmdb_url]
    argv += ["web", "--listen", listen]
    if first is not None:
        argv += ["--cluster-owner-root", str(first.root.path)]
        argv += ["--cluster-owner-key", str(first.owner_key)]
    with log.open("ab") as err:
        process = await trio.lowlevel.open_process(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )
    ready = trio.Event()
    urls: list[str] = []

    async def serve() -> None:
        try:
            assert process.stdout is not None
            buffer = b""
            async for chunk in process.stdout:
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace")
                    if text.startswith("serving on "):
                        urls.extend(text.removeprefix("serving on ").split())
                        ready.set()
            ready.set()
            await trio.sleep_forever()
        finally:
            await terminate(process, STOP_GRACE)

    nursery.start_soon(serve)
    with trio.fail_after(60):
        await ready.wait()
    if not urls:
        said = (await trio.Path(log).read_text(errors="replace")).strip().splitlines()
        raise DemoFailed(f"the web UI did not start: {said[-1] if said else 'no output'}")
    what = "the machines' pages" + (" and the cluster's nodes" if first is not None else "")
    logger.info("progress: web UI: %s (%s; open it in a browser)", " ".join(urls), what)
    return urls
