"""Running a node: a saved registration finished, then the role server under the
supervisor, until SIGINT or SIGTERM.

Apart from :mod:`metropolis.cli.node` (which prepares a root for it) so
that ``node recover`` can import it while the snapshot is restored.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import trio

from metropolis.localstorage import Root
from metropolis.roleserve import disk
from metropolis.roleserve.bootinfo import RunningImageSource
from metropolis.roleserve.register import DEFAULT_DEADLINE, register
from metropolis.roleserve.server import RoleServer
from metropolis.supervisor import Node, supervise

__all__ = ["run_node"]

log = logging.getLogger("metropolis.cli")


async def run_node(
    root: Root,
    metrics_listen: str | None = None,
    snapshots: tuple[Path, float, int] | None = None,
    register_deadline: float | None = None,
    boot_info: Path | None = None,
    announce_healthy: Path | None = None,
) -> None:
    """Finish a saved registration if there is one, then run the node; until a signal.

    ``metrics_listen``: serve the node's metrics there; ``snapshots``:
    (folder, interval, keep) of scheduled etcd snapshots;
    ``register_deadline``: how long the registration retries an outage of
    every curator (:func:`~metropolis.roleserve.register.register`; None:
    its default); ``boot_info``, ``announce_healthy``: what the boot chose,
    and where to say the node came up healthy
    (:mod:`metropolis.roleserve.bootinfo`, :mod:`metropolis.roleserve.bootcheck`).
    """
    saved = disk.load(root)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for signum in signals:
                    log.info("%s: stopping", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
            if saved.register is not None:
                deadline = DEFAULT_DEADLINE if register_deadline is None else register_deadline
                await register(root, saved.settings, saved.register, deadline=deadline)
                saved = disk.load(root)
            # An intent a crash left beside the credentials is done with.
            await trio.to_thread.run_sync(disk.drop_finished_intents, root)
            metrics = None
            if metrics_listen:
                # Imported only then: prometheus_client and the server.
                from metropolis.roleserve.metrics import NodeMetrics

                metrics = NodeMetrics(metrics_listen)
            server = RoleServer(
                root,
                saved,
                metrics=metrics,
                snapshots=snapshots,
                running=RunningImageSource(_absolute(boot_info)),
                announce_healthy=_absolute(announce_healthy),
            )

            async def main(node: Node) -> None:
                node.run("role", server.run)
                node.signal_healthy()
                await trio.sleep_forever()

            nursery.start_soon(supervise, main)


def _absolute(path: Path | None) -> Path | None:
    return None if path is None else Path(os.path.abspath(path))
