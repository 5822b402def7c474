"""Where a node's bootstrap to home spends its time: a per-phase trace.

    python -m bench.startup_trace [--runs 15] [--show 1] [--smoke]

A diagnostic beside ``bench.controlplane --only startup`` (same steps: a
bare etcd start, then a role server on a root holding only a bootstrap
intent, until home with local consensus and curator). It timestamps, on
the Trio clock relative to the start of each node, every log record (etcd's
own lines included, at the moment they arrive through its pipe) and the
start and end of the steps named in ``_STEPS`` (wrapped here, in this
process only), and prints the median time of each milestone over
``--runs`` nodes, and the whole timeline of the first ``--show`` ones.
No goal: this says where the time goes, ``bench.controlplane`` whether
it is enough; the one ratio it reports (median home against the median
bare etcd start) only shows the run in ``nox -s bench``'s closing table.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import inspect
import itertools
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from bench.consensus_start import bare_etcd_start
from bench.controlplane import _local
from bench.ratios import report
from bench.smoke import parse_args
from metropolis.consensus import process
from metropolis.localstorage import Root
from metropolis.roleserve import disk
from metropolis.roleserve.loopback import prepare_loopback_bootstrap
from metropolis.roleserve.server import RoleServer
from metropolis.supervisor import open_supervisor

#: (module, attribute path) of the steps whose start and end are traced.
_STEPS = [
    ("metropolis.roleserve.disk", "load"),
    ("metropolis.roleserve.server", "RoleServer.__init__"),
    ("metropolis.roleserve.controlplane", "ControlPlaneWorker._start"),
    ("metropolis.roleserve.controlplane", "_ClusterCreation.__init__"),
    ("metropolis.consensus.service", "Service._run"),
    ("metropolis.consensus.service", "Service._prepare_bootstrap_pki"),
    ("metropolis.consensus.service", "_make_durable"),
    ("metropolis.consensus.child", "EtcdChild.spawn"),
    ("metropolis.consensus.process", "_report_ready"),
    ("metropolis.consensus.service", "Service._store_bootstrap_pki"),
    ("metropolis.roleserve.controlplane", "_ClusterCreation.in_etcd"),
    ("metropolis.roleserve.controlplane", "ControlPlaneWorker._save_cluster_files"),
    ("metropolis.roleserve.disk", "save_credentials"),
    ("metropolis.roleserve.controlplane", "_warm_tls_contexts"),
    ("metropolis.curator.service", "Curator.run"),
]

_events: list[tuple[float, str]] = []
_t0 = 0.0


def _now() -> float:
    # perf_counter, not the Trio clock: worker threads note steps too.
    return time.perf_counter()


class _TaskTime(trio.abc.Instrument):
    """CPU time of the Trio thread per task (its name's last part), per phase."""

    def __init__(self) -> None:
        self.phase = "pre-spawn"
        self.spent: dict[str, dict[str, float]] = {}
        self._began = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._began = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        name = task.name.rsplit(".", 1)[-1]
        if name == "member":  # the supervisor's: name it after its runnable
            frame = getattr(task.coro, "cr_frame", None)
            if frame is not None:
                name = "member:" + str(frame.f_locals.get("name", "?"))
        phase = self.spent.setdefault(self.phase, {})
        phase[name] = phase.get(name, 0.0) + time.perf_counter() - self._began


_tasks = _TaskTime()


def _note(what: str) -> None:
    _events.append((_now() - _t0, what))
    for phase, marker in (
        ("etcd boot", "< EtcdChild.spawn"),
        ("after ready", "< _report_ready"),
        ("consensus running", "etcd member "),
        ("credentials committed", "< save_credentials"),
        ("after home", "HOME"),
    ):
        if marker in what:
            _tasks.phase = phase


class _Recorder(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        prefix = "etcd: " if record.name.endswith(".etcd") else ""
        _note(prefix + record.getMessage()[:110])


#: Wall clock minus perf_counter: etcd stamps its lines with the wall clock.
_WALL = time.time() - time.perf_counter()


def _trace_etcd_lines() -> None:
    """Note etcd's lines at the moment etcd wrote them (its "ts", in ms).

    The log records arrive when the Trio thread reads etcd's pipe, which
    is later whenever that thread is busy.
    """
    original = process._log_line

    def traced(line: bytes, logger: logging.Logger, fatal: list[str]) -> str:
        try:
            entry = json.loads(line)
            stamp = datetime.datetime.fromisoformat(entry["ts"]).timestamp()
        except (ValueError, KeyError, TypeError):
            pass
        else:
            _events.append((stamp - _WALL - _t0, f"etcd@ {entry.get('msg', '')}"[:110]))
        return original(line, logger, fatal)

    process._log_line = traced


def _wrap(owner: Any, name: str, label: str) -> None:
    original = inspect.getattr_static(owner, name)
    kind = type(original) if isinstance(original, staticmethod | classmethod) else None
    function: Callable[..., Any] = original.__func__ if kind else original
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            _note(f"> {label}")
            try:
                return await function(*args, **kwargs)
            finally:
                _note(f"< {label}")

        wrapped: Callable[..., Any] = traced_async
    else:

        @functools.wraps(function)
        def traced(*args: Any, **kwargs: Any) -> Any:
            _note(f"> {label}")
            try:
                return function(*args, **kwargs)
            finally:
                _note(f"< {label}")

        wrapped = traced
    setattr(owner, name, kind(wrapped) if kind else wrapped)


def _install() -> None:
    for module_name, path in _STEPS:
        module = importlib.import_module(module_name)
        *parents, name = path.split(".")
        owner: Any = module
        for parent in parents:
            owner = getattr(owner, parent)
        if hasattr(owner, name):
            _wrap(owner, name, path)
    _trace_etcd_lines()
    handler = _Recorder(level=logging.DEBUG)
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.DEBUG)
    for noisy in ("httpcore", "httpx", "hpack", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


#: Milestones whose median time is printed: (label, substring of an event).
_MILESTONES = [
    ("root read", "< load"),
    ("peer PKI made", "< Service._prepare_bootstrap_pki"),
    ("etcd spawned", "< EtcdChild.spawn"),
    ("PKI fsynced", "< _make_durable"),
    ("etcd: raft leader", "became leader"),
    ("etcd: ready to serve", "ready to serve client requests"),
    ("etcd answered", "< _report_ready"),
    ("cluster files fsynced", "< ControlPlaneWorker._save_cluster_files"),
    ("PKI stored", "< Service._store_bootstrap_pki"),
    ("cluster created", "< _ClusterCreation.in_etcd"),
    ("consensus running", "etcd member "),
    ("credentials committed", "< save_credentials"),
    ("TLS warmed", "< _warm_tls_contexts"),
    ("home", "HOME"),
]


#: The critical path, in steps: (label, substring of an event).
_GAPS = [
    ("etcd spawned", "< EtcdChild.spawn"),
    ("raft leader", "became leader"),
    ("etcd answered", "< _report_ready"),
    ("consensus running", "etcd member "),
    ("home", "HOME"),
]

#: etcd's start, as its log tells it (stamped by etcd, to the millisecond):
#: (label, substring of an event).
_ETCD_STEPS = [
    ("peer listeners", "etcd@ configuring peer listeners"),
    ("client listeners", "etcd@ configuring client listeners"),
    ("local member", "etcd@ starting local member"),
    ("server started", "etcd@ started as single-node"),
    ("raft leader", "etcd@ raft.node"),
    ("published", "etcd@ published local member"),
    ("serving clients", "etcd@ serving client traffic"),
    ("answered", "< _report_ready"),
]


def _median_after(timelines: list[list[tuple[float, str]]], since: str, needle: str) -> float:
    gaps = []
    for timeline in timelines:
        start = next((t for t, w in timeline if since in w), None)
        end = next((t for t, w in timeline if needle in w), None)
        if start is not None and end is not None:
            gaps.append(end - start)
    return statistics.median(gaps) * 1000 if gaps else float("nan")


async def _node_start(root: Root) -> None:
    """``bench.controlplane.node_start`` until home, noting the moment."""
    server = RoleServer(root, disk.load(root))
    async with open_supervisor(server.run, name="role"):
        with server.membership.watch() as w:
            membership = await w.get(_local)
        assert membership.local_consensus is not None
        await membership.local_consensus.wait_running()
        _note("HOME")


async def main(runs: int, show: int) -> None:
    global _t0
    _install()
    timelines: list[list[tuple[float, str]]] = []
    bare_timelines: list[list[tuple[float, str]]] = []
    bare: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-trace-") as tmp:
        base = Path(tmp)
        # One more than asked, the first thrown away: it pays for first
        # uses (imports, the first httpx client: half a second), which the
        # bench's median hides too.
        for i in range(runs + 1):
            if i == 1:
                timelines.clear()
                bare_timelines.clear()
                bare.clear()
                _tasks.spent.clear()
            root = Root(base / f"n{i}")
            prepare_loopback_bootstrap(root)
            _events.clear()
            _t0 = _now()
            bare.append(await bare_etcd_start(base / f"bare{i}"))
            bare_timelines.append(sorted(_events))
            _events.clear()
            _t0 = _now()
            _tasks.phase = "pre-spawn"
            _tasks.before_task_step(trio.lowlevel.current_task())  # this step, from now
            trio.lowlevel.add_instrument(_tasks)
            await _node_start(root)
            trio.lowlevel.remove_instrument(_tasks)
            timelines.append(sorted(_events))
    for timeline in timelines[:show]:
        print("--- one bootstrap (ms since start)")
        for t, what in timeline:
            print(f"{t * 1000:8.1f}  {what}")
    print("--- etcd's own start, ms after its spawn (median): bare / node")
    for label, needle in _ETCD_STEPS:
        both = [
            _median_after(tls, "< EtcdChild.spawn", needle) for tls in (bare_timelines, timelines)
        ]
        print(f"{label:<28} {both[0]:8.1f} {both[1]:8.1f}")
    print(f"--- Trio thread time per task and phase, summed over {runs} (ms)")
    for phase, spent in _tasks.spent.items():
        top = sorted(spent.items(), key=lambda kv: -kv[1])[:8]
        total = sum(spent.values()) * 1000 / runs
        tops = ", ".join(f"{k} {v * 1000 / runs:.1f}" for k, v in top)
        print(f"{phase} ({total:.1f}/run): {tops}")
    print("--- per-run gaps, median (ms)")
    steps = [("start", "> load"), *_GAPS]
    for (was, since), (label, needle) in itertools.pairwise(steps):
        print(f"{was:>17} -> {label:<18} {_median_after(timelines, since, needle):8.1f}")
    print(f"--- medians over {runs} (bare etcd start: {statistics.median(bare) * 1000:.0f} ms)")
    for label, needle in _MILESTONES:
        times = [next((t for t, w in tl if needle in w), None) for tl in timelines]
        found = [t for t in times if t is not None]
        if found:
            median, least = statistics.median(found) * 1000, min(found) * 1000
            print(f"{label:<24} {median:8.1f} ms  (min {least:.1f})")
    # Every node start ends with its HOME note.
    home = statistics.median(next(t for t, w in tl if w == "HOME") for tl in timelines)
    report("startup_trace", "home / bare etcd start", home / statistics.median(bare))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--show", type=int, default=1)
    args = parse_args(parser, {"runs": 1})
    trio.run(main, args.runs, args.show)
