"""A Shepherd-like worker process for the failover tests (started by them).

    python -m tests.bmdb.ha_worker URL NAME OUT HOLD INTERVAL

Runs one agent-start worker loop on the BMDB at ``URL`` (a multi-host URL)
until every machine is tagged: a new session whenever one is lost, every
retry through `common.backoff`. Each claimed machine is held ``HOLD``
seconds (a stand-in for the Shepherd's work on it) before it is finished.
On exit it writes ``OUT`` (JSON): every hold, as ``[machine, start, end,
port]``: times in ``time.monotonic()`` seconds (shared by the processes of
one Linux system), the port of the member that committed its finish (0 if
it was not acknowledged), and every session it held, as ``[start, end]``
(from the moment the session block was entered to the moment it was left).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import time

import trio

import bmdb
from bmdb.errors import BMDBError, DatabaseUnavailable, NothingToDo, SessionExpired, WorkConflict
from bmdb.model import Queries
from common.backoff import ExponentialBackoff, Retrier
from tests.bmdb.helpers import KEY, agent_start_source, outcome_counts

logger = logging.getLogger("tests.bmdb.ha_worker")

RETRY = ExponentialBackoff(initial=0.05, maximum=0.5)

#: (machine, start, end, port of the server that committed the finish or 0).
Hold = tuple[str, float, float, int]


async def _finish(work: bmdb.Work) -> int:
    """Finish agent-start work as the initializer does; return the port of
    the server that committed it (which member was the primary)."""
    machine_id = work.machine_id
    port = 0

    async def apply(q: Queries) -> None:
        nonlocal port
        await q.set_agent_started(machine_id, datetime.datetime.now(datetime.UTC), KEY)
        [(port,)] = await q.execute("SELECT inet_server_port()")

    await work.finish(apply)
    return int(port)


async def _all_tagged(conn: bmdb.Connection, total: int) -> bool:
    return (await outcome_counts(conn))["tagged"] == total


async def run(
    url: str, name: str, hold: float, interval: float
) -> tuple[list[Hold], list[tuple[float, float]]]:
    holds: list[Hold] = []
    sessions: list[tuple[float, float]] = []
    retrier = Retrier(RETRY)
    async with bmdb.open_connection(url) as conn:
        total = (await outcome_counts(conn))["machines"]
        while True:
            try:
                began: float | None = None
                async with conn.session("ha-worker", name, interval=interval) as sess:
                    began = time.monotonic()
                    while True:
                        try:
                            work = await sess.work(
                                bmdb.Process.SHEPHERD_AGENT_START, agent_start_source
                            )
                        except NothingToDo:
                            if await _all_tagged(conn, total):
                                return holds, sessions
                            await trio.sleep(0.1)
                            continue
                        except WorkConflict:
                            continue
                        start = time.monotonic()
                        port = 0
                        try:
                            async with work:
                                await trio.sleep(hold)
                                port = await _finish(work)
                        finally:
                            holds.append((str(work.machine_id), start, time.monotonic(), port))
                        retrier.reset()
            except (SessionExpired, DatabaseUnavailable, BMDBError) as e:
                logger.info("%s: %s; starting over", name, e)
                await retrier.sleep()
            finally:
                if began is not None:
                    sessions.append((began, time.monotonic()))


def main() -> None:
    url, name, out, hold, interval = sys.argv[1:6]
    # The failovers make the BMDB log warnings that are expected here.
    logging.basicConfig(level=logging.ERROR)
    holds, sessions = trio.run(run, url, name, float(hold), float(interval))
    with open(out, "w") as f:
        json.dump({"holds": holds, "sessions": sessions}, f)


if __name__ == "__main__":
    main()
