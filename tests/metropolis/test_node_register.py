"""``python -m metropolis node register`` killed at each of its write steps, then restarted.

A node process registers with a crash hook set (it SIGKILLs itself at the
named step, :mod:`metropolis.crashpoint`); the test approves every NEW node
as the owner would. Restarted (``run``, or ``register`` again with the same
arguments) the node must finish the registration with the keys the cluster
knows it by, or say in one line what to do; the cluster must end up with
exactly one record per registering root (no orphaned identities).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import trio

from common.net import free_loopback_port
from metropolis import identity, pki
from metropolis.crashpoint import CRASH_ENV
from metropolis.identity import NodeCredentials
from metropolis.localstorage import Root
from metropolis.owner import Owner, open_owner
from metropolis.roleserve import disk
from tests.metropolis.test_node_cli import LEADS, node

BOUND = 400

#: Every step at which a registering node writes or talks to the cluster, in order.
STEPS = (
    "register-after-settings",
    "register-after-intent",
    "register-after-register-rpc",
    "register-after-commit",
    "finish-before-credentials",
    "finish-credentials-staged",
    "finish-before-intent-removal",
)


async def _approve_forever(owner: Owner) -> None:
    # Polling: the registrations happen in other processes.
    while True:
        for row in await owner.nodes():
            if row.state == "NEW":
                await owner.approve(row.node_id)
        await trio.sleep(0.2)


async def _one_line_error(*args: str) -> str:
    """Run ``metropolis node ARGS``, expect it to fail with one logged error; that line."""
    result = await trio.run_process(
        [sys.executable, "-m", "metropolis", "node", *args], capture_stderr=True, check=False
    )
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, stderr
    return errors[0]


async def test_a_kill_at_each_register_step_resumes_with_the_same_identity(
    tmp_path: Path,
) -> None:
    seed = Root(tmp_path / "seed")
    owner_key = tmp_path / "owner.pem"
    curator_port = str(free_loopback_port())
    with trio.fail_after(BOUND):
        async with node(
            *("bootstrap", "--root", str(seed.path), "--address", "127.0.0.1"),
            *("--owner-key-out", str(owner_key), "--insecure-seal"),
            *("--peer-port", str(free_loopback_port()), "--curator-port", curator_port),
            *("--debug-port", str(free_loopback_port()), "--raft-tuning", "20,200"),
        ) as first:
            await first.wait_for(LEADS)
            await first.wait_for("status pushed")
            key = pki.decode_private_key(owner_key.read_bytes())
            async with open_owner(seed, key) as owner, trio.open_nursery() as nursery:
                ticket = (await owner.ticket()).hex()
                cluster = tmp_path / "cluster.pb"
                cluster.write_bytes(bytes(await owner.info()))
                nursery.start_soon(_approve_forever, owner)

                for i, step in enumerate(STEPS):
                    root = Root(tmp_path / f"r{i}")
                    register = [
                        *("register", "--root", str(root.path), "--address", "127.0.0.2"),
                        *("--ticket", ticket, "--directory", str(cluster), "--insecure-seal"),
                        *("--peer-port", str(free_loopback_port())),
                        *("--curator-port", curator_port),
                        *("--debug-port", str(free_loopback_port())),
                    ]
                    async with node(*register, env={CRASH_ENV: step}) as crashed:
                        pass
                    assert crashed.process.returncode == -signal.SIGKILL, step

                    expected: str | None = None
                    if step == "register-after-settings":
                        # Nothing reached the cluster: 'run' says to register again.
                        error = await _one_line_error("run", "--root", str(root.path))
                        assert "'node register' again" in error
                        restart = register
                    else:
                        saved = disk.load(root)
                        if saved.credentials is not None:
                            expected = saved.credentials.node_id
                        else:
                            assert saved.register is not None, step
                            expected = identity.node_id(saved.register.node_public_key)
                        # Both ways on: 'run', and the same 'register' command again.
                        restart = register if i % 2 else ["run", "--root", str(root.path)]
                    async with node(*restart) as resumed:
                        await resumed.wait_for("status pushed")
                        credentials = NodeCredentials.load(root.data.node_credentials)
                        if expected is not None:
                            assert credentials.node_id == expected, step
                        assert disk.load(root).register is None
                        assert not disk.register_path(root).exists()
                        resumed.process.send_signal(signal.SIGTERM)
                    assert resumed.process.returncode == 0, step
                    assert not resumed.logged("Traceback"), step

                    # A finished node is not registered over.
                    if step == STEPS[-1]:
                        assert "use 'run'" in await _one_line_error(*register)

                # One record per registering root: no identity was lost or doubled.
                rows = await owner.nodes()
                assert len(rows) == 1 + len(STEPS)
                assert all(row.state == "UP" for row in rows)
                nursery.cancel_scope.cancel()
            first.process.send_signal(signal.SIGTERM)
