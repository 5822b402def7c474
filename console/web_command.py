"""``python -m console web``: the BMDB connection, the metrics (if asked) and the
web UI, until SIGINT or SIGTERM. Imported by `console.__main__` once the
options are good.
"""

from __future__ import annotations

import argparse
import functools
import signal

import trio

import bmdb

__all__ = ["WEB_CONNECTIONS", "run"]


#: Database connections of the web UI: pages are served concurrently.
WEB_CONNECTIONS = 8


async def _web(conn: bmdb.Connection, args: argparse.Namespace) -> str:
    """Serve the web UI (and metrics, if asked) until SIGINT or SIGTERM."""
    # Imported here: the server and prometheus_client only when serving.
    from prometheus_client import CollectorRegistry

    from bmdb.metrics import ConnectionCollector, FleetGauges
    from common.metrics import serve_metrics
    from console.cluster import ClusterView
    from console.server import serve

    cluster = None
    if args.cluster_owner_root is not None:
        from metropolis.localstorage import Root
        from metropolis.owner import load_owner, load_owner_key

        # Read once, before serving: a wrong path is a start-up error, not
        # a page. Reaching the curators is left to each page.
        access = load_owner(
            Root(args.cluster_owner_root.resolve()), load_owner_key(args.cluster_owner_key)
        )
        cluster = ClusterView(access)

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            if args.metrics_listen:
                registry = CollectorRegistry()
                fleet = FleetGauges(conn, args.metrics_fleet_period)
                # The label dashboards know this connection by, kept from
                # when the UI was `bmdb web`.
                registry.register(ConnectionCollector(conn, "bmdb-web"))
                registry.register(fleet)
                metrics = await nursery.start(serve_metrics, registry, args.metrics_listen)
                print(f"metrics on {metrics[0]}/metrics", flush=True)
                await nursery.start(fleet.run)
            urls = await nursery.start(
                functools.partial(
                    serve, conn, args.listen, cluster=cluster, counts_period=args.counts_period
                )
            )
            print(f"serving on {' '.join(urls)}", flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break
    return "stopped"


async def run(args: argparse.Namespace) -> str:
    """Serve until SIGINT or SIGTERM; what to print then. Errors: `BMDBError`,
    `MetropolisError` (the cluster owner's files), `ConsoleError`."""
    # The web UI answers several browsers at once.
    async with bmdb.open_connection(args.url, max_connections=WEB_CONNECTIONS) as conn:
        return await _web(conn, args)
