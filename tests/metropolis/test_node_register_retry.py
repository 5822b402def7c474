"""``node register`` while no curator answers: it retries with backoff.

Against a real cluster whose only node is stopped, then started again: a
registering node started meanwhile logs its retries and, once the curator
is back and the owner approves it, commits and runs; with a short
``--register-deadline`` it gives up in one line naming the flag. A wrong
ticket is a final refusal: one line, no retry.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import trio

from common.net import free_loopback_port
from metropolis import identity, pki
from metropolis.localstorage import Root
from metropolis.owner import open_owner
from metropolis.proto import parameters
from metropolis.roleserve import disk
from tests.metropolis.test_node_cli import LEADS, node

BOUND = 240

#: What the registering node logs before each retry.
RETRY = "registering: UNAVAILABLE"


async def _fails(*args: str) -> tuple[str, str]:
    """Run ``metropolis node ARGS``, expect one logged error and exit 2: that line, and stderr."""
    result = await trio.run_process(
        [sys.executable, "-m", "metropolis", "node", *args], capture_stderr=True, check=False
    )
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, stderr
    return errors[0], stderr


def _ports(curator_port: str) -> list[str]:
    return [
        *("--peer-port", str(free_loopback_port())),
        *("--curator-port", curator_port),
        *("--debug-port", str(free_loopback_port())),
    ]


async def test_register_retries_until_the_curator_is_up_and_a_wrong_ticket_ends_at_once(
    tmp_path: Path,
) -> None:
    seed = Root(tmp_path / "seed")
    owner_key = tmp_path / "owner.pem"
    curator_port = str(free_loopback_port())
    params_file = tmp_path / "node-parameters.pb"
    with trio.fail_after(BOUND):
        async with node(
            *("bootstrap", "--root", str(seed.path), "--address", "127.0.0.1"),
            *("--owner-key-out", str(owner_key), "--insecure-seal", "--raft-tuning", "20,200"),
            *_ports(curator_port),
        ) as first:
            await first.wait_for(LEADS)
            await first.wait_for("status pushed")
            key = pki.decode_private_key(owner_key.read_bytes())
            async with open_owner(seed, key) as owner:
                params = parameters.register_parameters(
                    await owner.info(), await owner.ticket(), pki.public_key_bytes(key)
                )
            parameters.write(params_file, params)
            first.process.send_signal(signal.SIGTERM)
        assert first.process.returncode == 0

        def register(name: str, address: str, *extra: str) -> list[str]:
            return [
                *("register", "--root", str(tmp_path / name), "--address", address),
                *("--parameters", str(params_file), "--insecure-seal"),
                *_ports(curator_port),
                *extra,
            ]

        # No curator up: a short deadline gives up, in one line, after retries.
        error, said = await _fails(*register("short", "127.0.0.2", "--register-deadline", "2"))
        assert "no curator answered for 2 s (--register-deadline)" in error, said
        assert "UNAVAILABLE" in error and RETRY in said and "retry 1 in" in said, said

        # A node started while the curator is down waits for it.
        async with node(*register("r", "127.0.0.2", "--register-deadline", "200")) as joining:
            await joining.wait_for(RETRY)
            await joining.wait_for("retry 2 in")
            async with node("run", "--root", str(seed.path)) as again:
                await again.wait_for(LEADS)
                await joining.wait_for("waiting for the owner to approve")
                saved = disk.load(Root(tmp_path / "r")).register
                assert saved is not None
                node_id = identity.node_id(saved.node_public_key)
                async with open_owner(seed, key) as owner:
                    rows = {row.node_id: row for row in await owner.nodes()}
                    assert rows[node_id].state == "NEW"
                    await owner.approve(node_id)
                await joining.wait_for("committed: " + node_id)
                await joining.wait_for("status pushed")
                assert joining.process.returncode is None

                # A wrong ticket is refused at once: one line, no retry.
                cluster_file = tmp_path / "cluster.pb"
                cluster_file.write_bytes(bytes(parameters.cluster_info(params)))
                wrong, said = await _fails(
                    *("register", "--root", str(tmp_path / "wrong"), "--address", "127.0.0.3"),
                    *("--ticket", "00" * 16, "--directory", str(cluster_file)),
                    *("--insecure-seal", *_ports(curator_port)),
                )
                assert "PERMISSION_DENIED: wrong register ticket" in wrong, said
                assert "retry" not in said, said

                joining.process.send_signal(signal.SIGTERM)
                again.process.send_signal(signal.SIGTERM)
        assert joining.process.returncode == 0
