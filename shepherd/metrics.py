"""Prometheus metrics of the Shepherd's control loops (see `LoopStats`)::

    shepherd_control_loop_iterations_total{component, outcome}
        outcome: worked, nothing, conflict, session_lost
    shepherd_rate_limiter_waits_total{component}
    shepherd_rate_limiter_wait_seconds_total{component}

Collected in the Trio thread (see `common.metrics`).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from shepherd.control_loop import LoopStats


class LoopCollector(Collector):
    """Exports a `LoopStats`."""

    def __init__(self, stats: LoopStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        iterations = CounterMetricFamily(
            "shepherd_control_loop_iterations",
            "Control loop iterations by outcome (worked, nothing, conflict, session_lost).",
            labels=["component", "outcome"],
        )
        for (component, outcome), n in sorted(self._stats.iterations.items()):
            iterations.add_metric([component, outcome], n)
        yield iterations
        waits = CounterMetricFamily(
            "shepherd_rate_limiter_waits",
            "Iterations that waited for a rate limiter token.",
            labels=["component"],
        )
        for component, n in sorted(self._stats.limiter_waits.items()):
            waits.add_metric([component], n)
        yield waits
        seconds = CounterMetricFamily(
            "shepherd_rate_limiter_wait_seconds",
            "Seconds spent waiting for rate limiter tokens.",
            labels=["component"],
        )
        for component, s in sorted(self._stats.limiter_wait_seconds.items()):
            seconds.add_metric([component], s)
        yield seconds
