"""Where a grant of ConsensusMember spends its time: milestones per grant, against etcd's own.

    python -m bench.grant_trace [--runs 6] [--show 0] [--quiet] [--smoke]

A diagnostic beside ``bench.controlplane --only membership`` (same
cluster: n1 bootstrapped, n2 registered and running in this process; the
same-history bare cluster as baseline, paired the same way). Each run times
etcd's own join (member add, learner start, promote; its learner removed
again before the grant), then a grant to n2 until it votes and its curator
serves, then revokes it. For each grant it prints the
milestones (ms since the start: learner added, join data stored, roles
at n2, etcd spawned, serving, published, answering, promoted, voter,
curator API loaded and serving), the baseline's (spawned, serving,
published, answering), and the Trio thread's CPU per task in each phase
of the grant; ``--show`` prints whole timelines. etcd's milestones carry
etcd's own timestamps. ``--quiet`` traces nothing (no log records, no
wrapped steps: their cost is not small) and prints only the ratios.
Both print the CPU each side used (the learner's etcd from its start, the
leader's etcd and this process during the window), read from the kernel
after the window closes: on two cores the wall time follows the CPU.
No ratio is a goal here: this says where the time goes.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import resource
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from bench import startup_trace as trace
from bench.controlplane import (
    _HEALTHY_AFTER,
    BareCluster,
    _row,
    grant,
    in_process,
    paired_join,
    quiet_after_revoke,
    revoke,
    two_nodes,
)
from bench.ratios import report
from bench.smoke import parse_args

#: (module, attribute path) of the steps whose start and end are traced.
_STEPS = [
    ("metropolis.curator.managementapi", "ManagementAPI.update_node_roles"),
    ("metropolis.curator.membership", "Membership.grant"),
    ("metropolis.consensus.membership", "_add_learner"),
    ("metropolis.roleserve.disk", "save_roles"),
    ("metropolis.roleserve.controlplane", "ControlPlaneWorker._start"),
    ("metropolis.consensus.service", "Service._write_join_pki"),
    ("metropolis.consensus.child", "EtcdChild.spawn"),
    ("metropolis.consensus.process", "_report_ready"),
    ("metropolis.consensus.service", "wait_voter"),
    ("metropolis.consensus.promoter", "_promote"),
    ("metropolis.curator.server", "CuratorServer.load"),
]

#: A grant's milestones: (label, substring of an event).
_GRANT = [
    ("added", "< _add_learner"),
    ("stored", "< Membership.grant"),
    ("roles", "roles from the curator"),
    ("spawned", "< EtcdChild.spawn"),
    ("serving", "etcd@ now serving"),
    ("published", "etcd@ published local"),
    ("answers", "< _report_ready"),
    ("promoted", "promoted "),
    ("voter", "< _wait_voter"),
    ("loading", "> CuratorServer.load"),
    ("serves", "serving the curator API"),
    ("end", "GRANTED"),
]
#: The baseline's milestones.
_BARE = [
    ("spawned", "< EtcdChild.spawn"),
    ("serving", "etcd@ now serving"),
    ("published", "etcd@ published local"),
    ("answers", "< _report_ready"),
]
#: Phases of a grant for the CPU account: (phase, event that starts it).
_PHASES = [
    ("etcd start", "< EtcdChild.spawn"),
    ("promotion", "< _report_ready"),
    ("curator", "etcd member "),
    ("after", "GRANTED"),
]


#: The Trio thread's CPU per task and phase (startup_trace's instrument).
_tasks = trace._TaskTime()


def _install() -> None:
    """Wrap the steps, stamp etcd's lines, record every log record (and switch phases)."""
    note = trace._note

    def noted(what: str) -> None:
        note(what)
        for phase, marker in _PHASES:
            if marker in what:
                _tasks.phase = phase

    trace._note = noted  # the wrapped steps and the recorder call it by name
    for module_name, path in _STEPS:
        owner: Any = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        trace._wrap(owner, name, path)
    trace._trace_etcd_lines()
    logging.getLogger().addHandler(trace._Recorder(level=logging.DEBUG))
    logging.getLogger().setLevel(logging.DEBUG)
    for noisy in ("hpack", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _milestones(timeline: list[tuple[float, str]], marks: list[tuple[str, str]]) -> str:
    found = []
    for label, needle in marks:
        at = next((t for t, w in timeline if needle in w), None)
        found.append(f"{label} {at * 1000:.0f}" if at is not None else f"{label} -")
    return ", ".join(found)


@dataclass(frozen=True)
class _Cpu:
    """Seconds on CPU of one grant or join (all threads of each process)."""

    learner: float
    leader: float
    here: float


def _etcd_cpu(data_dir: Path) -> float:
    """Seconds on CPU so far of the etcd running on ``data_dir`` (schedstat, all threads)."""
    needle = f"--data-dir={data_dir}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle not in (proc / "cmdline").read_bytes().split(b"\0"):
                continue
            threads = (proc / "task").iterdir()
            return sum(int((t / "schedstat").read_text().split()[0]) for t in threads) / 1e9
        except OSError:
            continue  # gone meanwhile
    raise LookupError(f"no etcd runs on {data_dir}")


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _CpuWindow:
    """CPU from its creation to :meth:`close`; the learner's since it started."""

    def __init__(self, leader: Path) -> None:
        self._leader_dir = leader
        self._leader = _etcd_cpu(leader)
        self._here = _own_cpu()

    def close(self, learner: Path) -> _Cpu:
        here = _own_cpu() - self._here
        return _Cpu(_etcd_cpu(learner), _etcd_cpu(self._leader_dir) - self._leader, here)


def _cpu_table(grants: list[_Cpu], joins: list[_Cpu]) -> str:
    lines = ["--- CPU per grant / per etcd join (ms, medians; ratio: median per pair)"]
    for name, label in (
        ("learner", "learner etcd, from its start"),
        ("leader", "leader etcd"),
        ("here", "this process (both nodes, owner)"),
    ):
        j = [getattr(c, name) for c in joins]
        row = _row(label, [getattr(c, name) for c in grants], j)
        lines.append(
            f"{label}: {row.seconds * 1000:.0f} / {statistics.median(j) * 1000:.0f}"
            f" ({row.ratio:.2f}x)"
        )
    return "\n".join(lines)


def _restart_clock() -> None:
    trace._events.clear()
    trace._t0 = trace._now()


async def main(runs: int, show: int, quiet: bool) -> None:
    if not quiet:
        _install()
    timelines: list[tuple[list[tuple[float, str]], list[tuple[float, str]]]] = []
    joins: list[float] = []
    grants: list[float] = []
    join_cpu: list[_Cpu] = []
    grant_cpu: list[_Cpu] = []
    with tempfile.TemporaryDirectory(prefix="bench-grant-") as tmp:
        base = Path(tmp)
        async with (
            two_nodes(base / "cluster") as pair,
            BareCluster.open(base / "bare") as bare,
            in_process(pair) as n2,
        ):
            for _ in range(runs):
                window = _CpuWindow(bare.first_data_dir)
                _restart_clock()

                def joined(window: _CpuWindow = window) -> None:
                    assert bare.learner_data_dir is not None
                    join_cpu.append(window.close(bare.learner_data_dir))

                joins.append(await paired_join(bare, joined))
                bare_timeline = sorted(trace._events)
                window = _CpuWindow(pair.n1.root.data.etcd.data)
                _restart_clock()
                _tasks.phase = "before spawn"
                _tasks.before_task_step(trio.lowlevel.current_task())  # this step, from now
                trio.lowlevel.add_instrument(_tasks)
                grants.append(await grant(pair, n2))
                trio.lowlevel.remove_instrument(_tasks)
                trace._note("GRANTED")
                grant_cpu.append(window.close(pair.n2_root.data.etcd.data))
                timelines.append((sorted(trace._events), bare_timeline))
                await trio.sleep(_HEALTHY_AFTER)
                await revoke(pair, n2)
                await quiet_after_revoke(pair.n2_root)
    if not quiet:
        print("--- milestones, ms since the start of each (grant / etcd's own join)")
        for timeline, bare_timeline in timelines:
            print("grant:", _milestones(timeline, _GRANT))
            print("  own:", _milestones(bare_timeline, _BARE))
        print(f"--- Trio thread CPU per phase of a grant, mean of {runs} (ms)")
        for phase, spent in _tasks.spent.items():
            top = sorted(spent.items(), key=lambda kv: -kv[1])[:8]
            total = sum(spent.values()) * 1000 / runs
            tops = ", ".join(f"{k} {v * 1000 / runs:.1f}" for k, v in top)
            print(f"{phase} ({total:.1f}): {tops}")
        for timeline, _ in timelines[-show:] if show else []:
            print("--- one grant (ms since its start)")
            for t, what in timeline:
                print(f"{t * 1000:8.1f}  {what}")
    print(_cpu_table(grant_cpu, join_cpu))
    row = _row("grant", grants, joins)
    print(
        f"grant {row.seconds * 1000:.0f} ms, etcd's own join"
        f" {statistics.median(joins) * 1000:.0f} ms (medians); median ratio {row.ratio:.2f}"
    )
    report("grant_trace", "grant / etcd's own join", row.ratio)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--show", type=int, default=0, help="whole timelines of the last grants")
    parser.add_argument("--quiet", action="store_true", help="no tracing, only the ratios")
    args = parse_args(parser, {"runs": 1, "show": 1})
    trio.run(main, args.runs, args.show, args.quiet)
