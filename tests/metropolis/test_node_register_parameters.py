"""``node register --parameters FILE --announce-key FILE``, ``owner approve``, ``image``.

Against a real bootstrapped node: the registering node, given the
NodeParameters the fleet half writes, saves its identity, announces its
public key in a file before anyone approves it (and again when it resumes
after a kill), and the owner sees a NEW node with exactly that key, then
approves it with the CLI, which says what changed. Command lines that name
the cluster twice or not at all, and garbage files, are refused with one
line before the root is touched.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from common.net import free_loopback_port
from metropolis import identity, pki
from metropolis.crashpoint import CRASH_ENV
from metropolis.localstorage import Root
from metropolis.owner import open_owner
from metropolis.proto import parameters
from metropolis.roleserve import disk
from tests.metropolis.test_node_cli import LEADS, node
from tests.metropolis.test_node_register import _one_line_error

BOUND = 200


def _ports(curator_port: str) -> list[str]:
    return [
        *("--peer-port", str(free_loopback_port())),
        *("--curator-port", curator_port),
        *("--debug-port", str(free_loopback_port())),
    ]


async def _owner_cli(seed: Root, key: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [
            *(sys.executable, "-m", "metropolis", "owner", "--root", str(seed.path)),
            *("--owner-key", str(key), *args),
        ],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


async def _wait_file(path: Path) -> bytes:
    # Polling: another process writes the file.
    while not await trio.to_thread.run_sync(path.exists):  # noqa: ASYNC110
        await trio.sleep(0.05)
    return await trio.to_thread.run_sync(path.read_bytes)


async def test_register_with_parameters_announces_its_key_before_approval(
    tmp_path: Path,
) -> None:
    seed = Root(tmp_path / "seed")
    owner_key = tmp_path / "owner.pem"
    curator_port = str(free_loopback_port())
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
                params_file = tmp_path / "node-parameters.pb"
                parameters.write(params_file, params)
                root = Root(tmp_path / "r")
                announce = tmp_path / "announce" / "node.key"
                announce.parent.mkdir()
                register = [
                    *("register", "--root", str(root.path), "--address", "127.0.0.2"),
                    *("--parameters", str(params_file), "--insecure-seal"),
                    *("--announce-key", str(announce)),
                    *_ports(curator_port),
                ]
                # Killed right after its intent is saved: nothing announced
                # yet, and the cluster has not heard of it.
                async with node(*register, env={CRASH_ENV: "register-after-intent"}) as crashed:
                    pass
                assert crashed.process.returncode == -signal.SIGKILL
                assert not announce.exists()
                saved = disk.load(root).register
                assert saved is not None

                # The same command resumes: the key is announced again, before approval.
                async with node(*register) as resumed:
                    announced = await _wait_file(announce)
                    assert announced == saved.node_public_key and len(announced) == 32
                    assert announce.stat().st_mode & 0o777 == 0o644
                    assert not resumed.logged("owner public key")  # resumed: not read again
                    await resumed.wait_for("waiting for the owner to approve")
                    rows = {row.node_id: row for row in await owner.nodes()}
                    node_id = identity.node_id(announced)
                    assert rows[node_id].state == "NEW"
                    assert rows[node_id].public_key == announced

                    result = await _owner_cli(seed, owner_key, "approve", node_id)
                    assert result.returncode == 0, result.stderr
                    assert result.stdout.decode().startswith(f"approved {node_id} (address ")
                    await resumed.wait_for("status pushed")
                    # Approving it again is refused, naming its state.
                    again = await _owner_cli(seed, owner_key, "approve", node_id)
                    assert again.returncode == 2
                    assert again.stdout == b""
                    assert b"not NEW: nothing to approve" in again.stderr
                    resumed.process.send_signal(signal.SIGTERM)
                assert resumed.process.returncode == 0

                # A fresh registration from the parameters reads and logs them.
                root2 = Root(tmp_path / "r2")
                announce2 = tmp_path / "announce" / "node2.key"
                register2 = [
                    *("register", "--root", str(root2.path), "--address", "127.0.0.3"),
                    *("--parameters", str(params_file), "--insecure-seal"),
                    *("--announce-key", str(announce2)),
                    *_ports(curator_port),
                ]
                async with node(*register2) as fresh:
                    announced2 = await _wait_file(announce2)
                    await fresh.wait_for("waiting for the owner to approve")
                    assert fresh.logged(pki.public_key_bytes(key).hex())
                    saved2 = disk.load(root2).register
                    assert saved2 is not None and saved2.node_public_key == announced2
                    assert saved2.ticket == params.cluster_register.register_ticket  # type: ignore[union-attr]
                    # An ambiguous prefix approves nothing.
                    ambiguous = await _owner_cli(seed, owner_key, "approve", "metropolis-")
                    assert ambiguous.returncode == 2
                    assert b"names 3 nodes" in ambiguous.stderr
                    row = {r.node_id: r for r in await owner.nodes()}[identity.node_id(announced2)]
                    assert row.state == "NEW"
                    fresh.process.send_signal(signal.SIGTERM)
                assert fresh.process.returncode == 0
            first.process.send_signal(signal.SIGTERM)


def _register_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        *("register", "--root", str(tmp_path / "r"), "--address", "127.0.0.2"),
        "--insecure-seal",
        *extra,
    ]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        pytest.param(["--ticket", "00"], "give --parameters FILE, or both", id="ticket-only"),
        pytest.param([], "give --parameters FILE, or both", id="neither"),
        pytest.param(
            ["--parameters", "P", "--ticket", "00"], "give one or the other", id="both-ticket"
        ),
        pytest.param(
            ["--parameters", "P", "--directory", "C"], "give one or the other", id="both-dir"
        ),
        pytest.param(["--parameters", "GARBAGE"], "not a node parameters message", id="garbage"),
        pytest.param(["--parameters", "MISSING"], "cannot read", id="missing"),
        pytest.param(
            ["--ticket", "00", "--directory", "GARBAGE"], "not a cluster info file", id="bad-dir"
        ),
        # Parses as an empty message, which a lenient reader took for a
        # cluster and saved, to fail only when calling it.
        pytest.param(
            ["--ticket", "00", "--directory", "EMPTY"], "no cluster_directory", id="empty-dir"
        ),
    ],
)
async def test_register_refuses_bad_flags_and_files_in_one_line(
    tmp_path: Path, flags: list[str], expected: str
) -> None:
    garbage = tmp_path / "garbage.pb"
    garbage.write_bytes(b"\x0a\x05hello, not a message")
    names = {"GARBAGE": str(garbage), "MISSING": str(tmp_path / "nope"), "P": str(garbage)}
    names["C"] = str(garbage)
    names["EMPTY"] = str(tmp_path / "empty.pb")
    (tmp_path / "empty.pb").write_bytes(b"")
    args = _register_args(tmp_path, *(names.get(f, f) for f in flags))
    error = await _one_line_error(*args)
    assert expected in error
    if "GARBAGE" in flags and "--parameters" in flags and len(flags) == 2:
        assert str(garbage) in error
    assert not (tmp_path / "r").exists()


def test_image_command_is_the_image_tool(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "metropolis", "image", "build", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "--out" in result.stdout and "--etcd" in result.stdout
    listed = subprocess.run(
        [sys.executable, "-m", "metropolis", "--help"], capture_output=True, text=True, timeout=60
    )
    assert "image" in listed.stdout
    # A bad --etcd goes through the image tool's own one-line error.
    bad = subprocess.run(
        [
            *(sys.executable, "-m", "metropolis", "image", "build"),
            *("--out", str(tmp_path / "out"), "--etcd", str(tmp_path / "no-etcd")),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1
    assert bad.stderr.startswith("metropolis image: ")
