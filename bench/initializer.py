"""Initializer fleet throughput against OpenSSH's own client, measured in one run.

    python -m bench.initializer [--machines 200] [--parallelism 16] [--agent-mib 4] [--smoke]

Two kinds of target, each serving ``--machines`` machines:

- one real OpenSSH sshd on loopback (every machine is the same server);
- asyncssh servers, one per machine, in a separate process
  (``shepherd/localfleet.py``), so they do not share our CPU time slice.

Against each, with the same parallelism, the same agent (the real takeover
agent packed as a zipapp padded to ``--agent-mib`` MiB) and the same stdin:

- baseline: OpenSSH's client, one multiplexed connection per machine:
  ``ssh -M`` (ControlMaster) + ``sftp`` (put, chmod 755, rename) + ``ssh``
  (run with the TakeoverInit on stdin; the answer is checked) + ``ssh -O exit``;
- shepherd: the full initializer: BMDB (PostgreSQL) sourcing and work locks,
  static provider, asyncssh through trio-asyncio, response checks, finish().

Prints machines/minute and the ratio shepherd/baseline per target (with
``--rounds N``, N alternating pairs and the median ratio). The rate limiter is
set to 5ms,16 so that it does not bound the throughput.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import betterproto2
import trio
import trio_asyncio

import bmdb
from bench.ratios import report
from bench.smoke import parse_args
from bmdb import Provider, Queries
from bmdb.localserver import LocalPostgres
from shepherd.agent_bundle import agent_zipapp
from shepherd.agent_start import AgentConfig
from shepherd.control_loop import start_control_loop
from shepherd.initializer import Initializer
from shepherd.localsshd import start_sshd, stop_sshd
from shepherd.proto.agent import TakeoverInit, TakeoverResponse
from shepherd.providers import Machine
from shepherd.providers.static import StaticProvider
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.ssh import SSHClient
from shepherd.ssh_key import SSHKey

ROOT = Path(__file__).resolve().parent.parent
ENDPOINT = "bmaas.example:443"
BASELINE = "OpenSSH ssh+sftp, ControlMaster"
SHEPHERD = "shepherd initializer + BMDB"


@dataclass(frozen=True)
class Target:
    """Where the machines are: (host, port) per machine and the agent's path there."""

    name: str
    addresses: list[tuple[str, int]]
    target_path: str


def build_agent(size: int) -> bytes:
    """The takeover agent's zipapp, padded with incompressible data to ``size`` bytes."""
    buffer = io.BytesIO(agent_zipapp())
    with zipfile.ZipFile(buffer, "a", zipfile.ZIP_STORED) as archive:
        padding = max(0, size - len(buffer.getvalue()) - 200)
        archive.writestr("payload.bin", os.urandom(padding))
    return buffer.getvalue()


# --- baseline: OpenSSH client -------------------------------------------------


async def _check(argv: list[str], stdin: bytes = b"") -> bytes:
    done = await trio.run_process(argv, stdin=stdin, capture_stdout=True, capture_stderr=True)
    return bytes(done.stdout)


async def openssh_one(
    index: int, host: str, port: int, key: Path, agent: Path, target: str, work: Path
) -> None:
    control = work / f"ctl-{index}"
    common = [
        "-i", str(key),
        "-o", "IdentitiesOnly=yes",
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=no",
        "-o", "UserKnownHostsFile=/dev/null",
        "-o", "LogLevel=ERROR",
        "-o", f"ControlPath={control}",
    ]  # fmt: skip
    login = f"root@{host}"
    await _check(
        ["ssh", *common, "-p", str(port), "-o", "ControlMaster=yes", "-o", "ControlPersist=yes",
         "-f", "-N", login]
    )  # fmt: skip
    try:
        tmp = f"{target}.upload-{index}"
        batch = work / f"batch-{index}"
        batch.write_text(f"put {agent} {tmp}\nchmod 755 {tmp}\nrename {tmp} {target}\n")
        await _check(["sftp", *common, "-P", str(port), "-b", str(batch), login])
        init = TakeoverInit(machine_id=str(uuid.uuid4()), bmaas_endpoint=ENDPOINT)
        out = await _check(["ssh", *common, "-p", str(port), login, target], stdin=bytes(init))
        response = TakeoverResponse.parse(out)
        which, _ = betterproto2.which_one_of(response, "result")
        if which != "success" or response.success is None:
            raise RuntimeError(f"agent did not succeed: {response}")
        if response.success.init_message != init:
            raise RuntimeError("agent did not echo the init message")
    finally:
        await _check(["ssh", *common, "-p", str(port), "-O", "exit", login])


async def openssh_baseline(target: Target, key: Path, agent: Path, parallelism: int) -> float:
    work = Path(tempfile.mkdtemp(prefix="bench-ssh-"))
    limiter = trio.CapacityLimiter(parallelism)

    async def one(index: int, host: str, port: int) -> None:
        async with limiter:
            await openssh_one(index, host, port, key, agent, target.target_path, work)

    start = trio.current_time()
    try:
        async with trio.open_nursery() as nursery:
            for index, (host, port) in enumerate(target.addresses):
                nursery.start_soon(one, index, host, port)
        return trio.current_time() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- shepherd: the initializer on the BMDB -------------------------------------


async def shepherd_run(
    url: str, target: Target, key: SSHKey, agent: bytes, parallelism: int
) -> float:
    count = len(target.addresses)
    async with bmdb.open_connection(url, migrate=True) as conn:

        async def add(q: Queries) -> None:
            for index in range(count):
                mid = await q.new_machine()
                await q.add_provided(mid, Provider.STATIC, f"m-{index}")

        await conn.transact(add)
        provider = StaticProvider(
            [Machine(f"m-{i}", host, port) for i, (host, port) in enumerate(target.addresses)]
        )
        config = AgentConfig(
            executable=agent,
            target_path=target.target_path,
            endpoint=ENDPOINT,
            endpoint_ca_certificate=b"",
            ssh_connect_timeout=30.0,
            ssh_exec_timeout=120.0,
        )
        ssh = SSHClient(key, username="root", connect_timeout=config.ssh_connect_timeout)
        initializer = Initializer(provider, ssh, config)

        async def started(q: Queries) -> tuple[int, int]:
            # One statement per poll: the poll shares the CPU with what it
            # measures (a query per machine made it cost more than the work).
            [(done, failed)] = await q.execute(
                """SELECT (SELECT count(*) FROM machine_agent_started),
                          (SELECT count(*) FROM work_history
                           WHERE process = %s::process AND event = %s::work_history_event)""",
                (bmdb.Process.SHEPHERD_AGENT_START, bmdb.WorkEvent.FAILED),
            )
            return int(done), int(failed)

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            start_control_loop(
                nursery,
                conn,
                initializer,
                parallelism=parallelism,
                limiter=RateLimiter(Rate(0.005, parallelism)),
            )
            while True:
                done, failed = await conn.transact(started)
                if failed:
                    raise RuntimeError(f"{failed} machine(s) failed; see the log")
                if done == count:
                    break
                await trio.sleep(0.02)
            elapsed = trio.current_time() - start
            nursery.cancel_scope.cancel()
        return elapsed


# --- the run --------------------------------------------------------------------


def start_fleet(directory: Path, count: int, key: SSHKey) -> tuple[subprocess.Popen[str], Target]:
    argv = [sys.executable, "-m", "shepherd.localfleet", str(directory), str(count)]
    process = subprocess.Popen(
        [*argv, key.authorized_key],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    addresses = []
    for line in process.stdout:
        if line.strip() == "ready":
            break
        machine = json.loads(line)
        addresses.append((str(machine["host"]), int(machine["port"])))
    if len(addresses) != count:
        process.kill()
        raise RuntimeError("the fleet process did not start")
    return process, Target("asyncssh fleet (other process)", addresses, "/agent")


async def main_async(args: argparse.Namespace, work: Path) -> list[tuple[str, str, float]]:
    key = SSHKey.generate()
    key_path = work / "id_ed25519"
    key_path.write_bytes(key.openssh_private)
    key_path.chmod(0o600)
    agent = build_agent(args.agent_mib * 1024 * 1024)
    agent_path = work / "agent.pyz"
    agent_path.write_bytes(agent)

    # Its own temp dir: the server runs as the postgres user, which cannot
    # enter our private work directory.
    postgres = LocalPostgres(Path(tempfile.mkdtemp(prefix="bench-pg-")))
    postgres.create()
    postgres.start()
    sshd_process, sshd = start_sshd(work / "sshd", [key.authorized_key])
    fleet_process, fleet = start_fleet(work / "fleet", args.machines, key)
    results: list[tuple[str, str, float]] = []
    try:
        targets = [
            Target(
                "OpenSSH sshd",
                [(sshd.host, sshd.port)] * args.machines,
                str(sshd.root / "agent"),
            ),
            fleet,
        ]
        async with trio_asyncio.open_loop():
            # Baseline and shepherd alternate, round after round, so that
            # a burst of noise from elsewhere hits both alike.
            for index, target in enumerate(targets):
                for round_ in range(args.rounds):
                    seconds = await openssh_baseline(target, key_path, agent_path, args.parallelism)
                    results.append((target.name, BASELINE, seconds))
                    database = f"bench_{index}_{round_}"
                    postgres.admin(f"CREATE DATABASE {database}")
                    seconds = await shepherd_run(
                        postgres.url(database), target, key, agent, args.parallelism
                    )
                    results.append((target.name, SHEPHERD, seconds))
    finally:
        fleet_process.kill()
        fleet_process.wait()
        stop_sshd(sshd_process)
        postgres.stop()
        shutil.rmtree(postgres.root, ignore_errors=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=200)
    parser.add_argument("--parallelism", type=int, default=16)
    parser.add_argument("--agent-mib", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="baseline/shepherd pairs per target")
    args = parse_args(parser, {"machines": 2, "parallelism": 2, "agent_mib": 1})
    work = Path(tempfile.mkdtemp(prefix="bench-initializer-"))
    try:
        results = trio.run(main_async, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\n{args.machines} machines, parallelism {args.parallelism}, "
        f"{args.agent_mib} MiB agent, {os.cpu_count()} CPUs\n"
    )
    print(f"{'target':<32} {'client':<34} {'seconds':>8} {'machines/min':>13} {'ratio':>6}")
    baseline = 0.0
    ratios: dict[str, list[float]] = {}
    for target, client, seconds in results:
        rate = args.machines / seconds * 60
        if client == BASELINE:
            baseline = rate
        else:
            ratios.setdefault(target, []).append(rate / baseline)
        print(f"{target:<32} {client:<34} {seconds:>8.1f} {rate:>13.0f} {rate / baseline:>6.2f}")
    for target, values in ratios.items():
        report("initializer", f"{target}: machines/min vs baseline (median)", median(values))
    if args.rounds > 1:
        print()
        for target, values in ratios.items():
            print(f"{target:<32} median ratio over {len(values)} rounds: {median(values):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
