"""Counts of the calls a :class:`~metropolis.rpc.server.Server` answered, for Prometheus::

    metropolis_rpc_calls_total{server, method, code}
    metropolis_rpc_call_duration_seconds{server, method}   (histogram)

``server`` names the server (``curator``, ``debug``), ``method`` is the
gRPC path of a registered method, and ``code`` the status name the call
ended with (``OK``, ``UNAVAILABLE``, ...; ``CANCELLED`` when the caller
left first). A path no method is registered at counts as ``unknown``: the
labels come from what a caller without credentials sends, and must not
grow with it. The duration runs from the request's headers to the last
frame of the answer (for a stream, the whole stream).

:class:`RPCMetrics` only counts, in the Trio thread, with no lock; its
:meth:`~RPCMetrics.collect` runs in the same thread (``common.metrics``
collects there).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from metropolis.rpc.method import UNKNOWN_METHOD

__all__ = ["BUCKETS", "UNKNOWN_METHOD", "RPCMetrics"]

#: Upper bounds (seconds) of the latency histogram's buckets; +Inf is added.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class _Latency:
    #: One count per bucket of :data:`BUCKETS`, then one for +Inf (not cumulative).
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0


class RPCMetrics(Collector):
    """Calls by server, method and status code, with latency histograms."""

    def __init__(self) -> None:
        self._calls: dict[tuple[str, str, str], int] = {}
        self._latency: dict[tuple[str, str], _Latency] = {}

    def observe(self, server: str, method: str, code: str, seconds: float) -> None:
        """Count one finished call."""
        key = (server, method, code)
        self._calls[key] = self._calls.get(key, 0) + 1
        latency = self._latency.get((server, method))
        if latency is None:
            latency = self._latency[(server, method)] = _Latency()
        latency.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        latency.total += seconds

    def calls(self, server: str, method: str, code: str) -> int:
        """How many calls ended so (for tests and diagnostics)."""
        return self._calls.get((server, method, code), 0)

    def collect(self) -> Iterator[Metric]:
        calls = CounterMetricFamily(
            "metropolis_rpc_calls",
            "RPC calls answered, by server, method and gRPC status code.",
            labels=["server", "method", "code"],
        )
        for (server, method, code), n in sorted(self._calls.items()):
            calls.add_metric([server, method, code], n)
        yield calls
        durations = HistogramMetricFamily(
            "metropolis_rpc_call_duration_seconds",
            "Time from a call's request headers to the end of its answer.",
            labels=["server", "method"],
        )
        for (server, method), latency in sorted(self._latency.items()):
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip((*map(str, BUCKETS), "+Inf"), latency.counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            durations.add_metric([server, method], buckets, latency.total)
        yield durations
