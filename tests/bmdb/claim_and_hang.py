"""A worker that claims one agent-start machine and hangs (killed by tests).

    python -m tests.bmdb.claim_and_hang URL INTERVAL

Prints ``<session id> <machine id>`` once the claim is committed, then keeps
its session alive until it is killed.
"""

from __future__ import annotations

import sys

import trio

import bmdb
from tests.bmdb.helpers import agent_start_source


async def main(url: str, interval: float) -> None:
    async with (
        bmdb.open_connection(url) as conn,
        conn.session("doomed-worker", "claim_and_hang", interval=interval) as sess,
    ):
        work = await sess.work(bmdb.Process.SHEPHERD_AGENT_START, agent_start_source)
        print(sess.id, work.machine_id, flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], float(sys.argv[2]))
