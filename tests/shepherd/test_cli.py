"""``python -m shepherd``: option checking, and a real run against sshd and the BMDB."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, generate_private_key
from cryptography.x509.oid import NameOID

import bmdb
from bmdb import WorkEvent
from bmdb.localserver import LocalPostgres
from shepherd.agent_bundle import agent_zipapp
from shepherd.cli import parse_options
from shepherd.localsshd import Sshd
from shepherd.ssh_key import SSHKey, load_ssh_key
from tests.shepherd.agents import kill_agent
from tests.shepherd.helpers import agent_keys, events

MACHINES = '[[machine]]\nid = "m-1"\naddress = "127.0.0.1"\n'


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    machines = tmp_path / "machines.toml"
    machines.write_text(MACHINES)
    return {"machines": machines, "key": tmp_path / "id_ed25519"}


def _argv(files: dict[str, Path], *extra: str, drop: str | None = None) -> list[str]:
    options = {
        "--bmdb-url": "postgresql:///bmdb",
        "--provider": "static",
        "--static-machines-path": str(files["machines"]),
        "--ssh-key-path": str(files["key"]),
        "--agent-endpoint": "bmaas.example:443",
    }
    options.pop(drop or "", None)
    return [item for pair in options.items() for item in pair] + list(extra)


def _self_signed_certificate() -> x509.Certificate:
    key = generate_private_key(SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bmaas CA")])
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )


def test_defaults_follow_the_seed(files: dict[str, Path]) -> None:
    options = parse_options(_argv(files))
    assert options.agent.target_path == "/root/agent"
    assert options.agent.ssh_connect_timeout == 2.0
    assert options.agent.ssh_exec_timeout == 60.0
    assert options.agent.endpoint_ca_certificate == b""
    assert options.agent.executable == agent_zipapp()
    assert (options.rate.interval, options.rate.burst) == (0.25, 8)
    assert options.parallelism == 1
    assert options.provider.type == "Static"
    assert (options.agent.heartbeat_interval, options.agent.heartbeat_backoff_cap) == (10.0, 60.0)
    recoverer = options.recoverer
    assert (recoverer.rate.interval, recoverer.rate.burst, recoverer.parallelism) == (0.25, 8, 1)
    assert (recoverer.first_heartbeat_timeout, recoverer.heartbeat_timeout) == (1800.0, 600.0)
    assert options.pruner is None  # retention is the operator's decision
    # The key was generated and persisted where asked.
    assert load_ssh_key(files["key"]).authorized_key == options.ssh_key.authorized_key


def test_all_options(files: dict[str, Path], tmp_path: Path) -> None:
    certificate = _self_signed_certificate()
    ca = tmp_path / "ca.pem"
    ca.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    agent = tmp_path / "agent.bin"
    agent.write_bytes(b"\x7fELF pretend")
    options = parse_options(
        _argv(
            files,
            "--agent-endpoint-ca-certificate-path",
            str(ca),
            "--agent-executable-path",
            str(agent),
            "--agent-target-path",
            "/tmp/agent",
            "--agent-ssh-connect-timeout",
            "1500ms",
            "--agent-ssh-exec-timeout",
            "2m",
            "--initializer-db-query-rate",
            "1s,3",
            "--initializer-parallelism",
            "16",
            "--agent-heartbeat-interval",
            "2s",
            "--agent-heartbeat-backoff-cap",
            "30s",
            "--recoverer-db-query-rate",
            "2s,2",
            "--recoverer-parallelism",
            "3",
            "--recovery-first-heartbeat-timeout",
            "1h",
            "--recovery-heartbeat-timeout",
            "90s",
        )
    )
    assert (options.agent.heartbeat_interval, options.agent.heartbeat_backoff_cap) == (2.0, 30.0)
    recoverer = options.recoverer
    assert (recoverer.rate.interval, recoverer.rate.burst, recoverer.parallelism) == (2.0, 2, 3)
    assert (recoverer.first_heartbeat_timeout, recoverer.heartbeat_timeout) == (3600.0, 90.0)
    assert options.agent.endpoint_ca_certificate == certificate.public_bytes(
        serialization.Encoding.DER
    )
    assert options.agent.executable == b"\x7fELF pretend"
    assert options.agent.target_path == "/tmp/agent"
    assert (options.agent.ssh_connect_timeout, options.agent.ssh_exec_timeout) == (1.5, 120.0)
    assert (options.rate.interval, options.rate.burst, options.parallelism) == (1.0, 3, 16)


@pytest.mark.parametrize(
    "option",
    [
        "--bmdb-url",
        "--provider",
        "--static-machines-path",
        "--ssh-key-path",
        "--agent-endpoint",
    ],
)
def test_missing_required_option_is_named(
    files: dict[str, Path], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_options(_argv(files, drop=option))
    assert exited.value.code == 2
    assert f"required: {option}" in capsys.readouterr().err
    assert not files["key"].exists()  # nothing started, nothing written


def _write(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    path.chmod(0o600)  # as a key file must be
    return str(path)


@pytest.mark.parametrize(
    ("option", "value", "error"),
    [
        ("--agent-endpoint-ca-certificate-path", b"hello\n", "no PEM block found"),
        (
            "--agent-endpoint-ca-certificate-path",
            b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
            "not a certificate (PEM block is 'PRIVATE KEY')",
        ),
        (
            "--agent-endpoint-ca-certificate-path",
            b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            "invalid certificate",
        ),
        (
            "--agent-endpoint-ca-certificate-path",
            b"-----BEGIN CERTIFICATE-----\n" + b"A" * (1 << 20) + b"\n-----END CERTIFICATE-----\n",
            "larger than 1 MiB; refusing it",
        ),
        ("--agent-executable-path", b"", "is empty"),
        ("--static-machines-path", b'[[machine]]\nid = "a"\nadres = "b"\n', ":3: unknown field"),
        ("--ssh-key-path", b"not a key", "not a valid unencrypted private key"),
    ],
)
def test_bad_files_are_clear_errors(
    files: dict[str, Path],
    tmp_path: Path,
    option: str,
    value: bytes,
    error: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _write(tmp_path, "bad-file", value)
    with pytest.raises(SystemExit) as exited:
        parse_options([*_argv(files, drop=option), option, path])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err
    assert error in err


@pytest.mark.parametrize(
    ("option", "value", "error"),
    [
        ("--agent-endpoint-ca-certificate-path", "/nonexistent/ca.pem", "could not read"),
        ("--initializer-db-query-rate", "250ms", "invalid syntax, want: 'duration,count'"),
        ("--initializer-db-query-rate", "1d,8", 'unknown unit "d"'),
        ("--initializer-db-query-rate", "1s,zero", "invalid refill rate"),
        ("--agent-ssh-connect-timeout", "2", "missing unit in duration"),
        ("--agent-ssh-exec-timeout", "0s", "duration must be positive"),
        ("--initializer-parallelism", "0", "must be at least 1"),
        ("--provider", "openstack", "invalid choice: 'openstack'"),
        ("--provisioner-max-machines", "-1", "must not be negative"),
        ("--provisioner-reservation-chunk-size", "0", "must be at least 1"),
        ("--provisioner-device-creation-rate", "5s", "invalid syntax"),
        ("--updater-batch-size", "0", "must be at least 1"),
        ("--static-bmc-credentials-path", "/nonexistent/bmc.toml", "cannot read BMC credentials"),
        ("--static-bmc-ca-certificate-path", "/nonexistent/ca.pem", "could not read"),
        ("--agent-heartbeat-interval", "0s", "duration must be positive"),
        ("--recovery-heartbeat-timeout", "10", "missing unit in duration"),
        ("--recoverer-parallelism", "0", "must be at least 1"),
        ("--retention-keep-last", "-1", "must not be negative"),
        ("--retention-keep-newer-than", "90", "not an age: '90'"),
        ("--retention-interval", "0s", "duration must be positive"),
    ],
)
def test_bad_values_are_clear_errors(
    files: dict[str, Path],
    option: str,
    value: str,
    error: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_options([*_argv(files, drop=option), option, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err
    assert error in err


async def test_python_m_shepherd_starts_an_agent_and_stops_on_sigterm(
    bmdb_conn: bmdb.Connection,
    bmdb_url: str,
    sshd: Sshd,
    shepherd_ssh_key: SSHKey,
    tmp_path: Path,
) -> None:
    machines = tmp_path / "machines.toml"
    machines.write_text(f'[[machine]]\nid = "m-1"\naddress = "{sshd.host}"\nport = {sshd.port}\n')
    key = tmp_path / "id_ed25519"
    key.write_bytes(shepherd_ssh_key.openssh_private)
    key.chmod(0o600)
    log = tmp_path / "shepherd.log"
    argv = [
        sys.executable,
        "-m",
        "shepherd",
        "--bmdb-url",
        bmdb_url,
        "--provider",
        "static",
        "--static-machines-path",
        str(machines),
        "--ssh-key-path",
        str(key),
        "--agent-endpoint",
        "bmaas.example:443",
        "--agent-target-path",
        str(sshd.root / "agent"),
        "--initializer-parallelism",
        "2",
    ]
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        try:
            with trio.fail_after(60):
                # The machine listed in the file is brought into the BMDB by
                # the CLI itself, then taken over.
                while not await agent_keys(bmdb_conn):  # noqa: ASYNC110
                    await trio.sleep(0.05)
                process.send_signal(signal.SIGTERM)
                assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            # The agent detached to heartbeat (to nowhere, here).
            kill_agent(sshd.root / "agent")
    (mid,) = await agent_keys(bmdb_conn)
    assert [e for e, _ in await events(bmdb_conn, mid)] == [
        WorkEvent.STARTED,
        WorkEvent.FINISHED,
    ]
    text = log.read_text()
    assert f"machine {mid}: agent started, key" in text
    assert "got SIGTERM, stopping" in text
    assert "shepherd-recoverer: starting 1 worker(s)" in text

    async def leftovers(q: bmdb.Queries) -> int:
        return len(await q.sessions())

    assert await bmdb_conn.transact(leftovers) == 0


async def test_bmdb_errors_reach_the_operator_as_one_line(
    files: dict[str, Path], postgres_server: LocalPostgres
) -> None:
    """Unreachable and unmigrated databases: the leaf error, not a group's summary."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"postgresql://postgres@127.0.0.1:{s.getsockname()[1]}/x"
    postgres_server.admin("CREATE DATABASE shepherd_cli_unmigrated")
    try:
        for url, want in [
            (dead, "shepherd: error: cannot connect to the BMDB"),
            (postgres_server.url("shepherd_cli_unmigrated"), "shepherd: error: "),
        ]:
            argv = _argv(files)
            argv[argv.index("--bmdb-url") + 1] = url
            result = await trio.run_process(
                [sys.executable, "-m", "shepherd", *argv],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            err = result.stderr.decode()
            last = err.strip().splitlines()[-1]
            assert result.returncode == 1, err
            assert last.startswith(want), err
            assert "Trio nursery" not in err and "Traceback" not in err, err
    finally:
        postgres_server.admin("DROP DATABASE shepherd_cli_unmigrated WITH (FORCE)")


def test_no_key_is_created_when_validation_fails(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_options([*_argv(files, drop="--agent-endpoint"), "--agent-endpoint", ""])
    assert "agent endpoint must be set" in capsys.readouterr().err
    assert not files["key"].exists()


async def test_key_creation_is_logged_with_its_absolute_path(
    files: dict[str, Path], tmp_path: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"postgresql://postgres@127.0.0.1:{s.getsockname()[1]}/x"
    argv = _argv(files, drop="--ssh-key-path")
    argv[argv.index("--bmdb-url") + 1] = dead
    result = await trio.run_process(
        [sys.executable, "-m", "shepherd", *argv, "--ssh-key-path", "relative_key"],
        cwd=tmp_path,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert f"generated new SSH key {tmp_path / 'relative_key'}: ssh-ed25519 " in err


def test_retention_options(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    options = parse_options(
        _argv(files, "--retention-keep-last", "50", "--retention-keep-newer-than", "90d")
    )
    assert options.pruner is not None
    assert options.pruner.policy.keep_last == 50
    assert options.pruner.policy.keep_newer_than == datetime.timedelta(days=90)
    assert options.pruner.interval == 3600.0
    options = parse_options(
        _argv(
            files,
            *("--retention-keep-last", "0", "--retention-keep-newer-than", "12h"),
            *("--retention-interval", "10m"),
        )
    )
    assert options.pruner is not None and options.pruner.interval == 600.0
    for flags, error in [
        (["--retention-keep-last", "5"], "go together"),
        (["--retention-keep-newer-than", "1d"], "go together"),
        (["--retention-interval", "1h"], "--retention-interval needs"),
    ]:
        with pytest.raises(SystemExit) as exited:
            parse_options(_argv(files, *flags))
        assert exited.value.code == 2
        assert error in capsys.readouterr().err


def test_the_parser_s_defaults_are_the_loops_own() -> None:
    """`shepherd.arguments` writes down the defaults of modules it does not
    import (so that --help imports none of them): the same values."""
    from bmdb.metrics import DEFAULT_FLEET_PERIOD
    from bmdb.model import AGENT_FIRST_HEARTBEAT_TIMEOUT, AGENT_HEARTBEAT_TIMEOUT
    from shepherd import arguments
    from shepherd.approver import DEFAULT_INTERVAL as APPROVE_INTERVAL
    from shepherd.providers.equinix.client import DEFAULT_API_URL
    from shepherd.pruner import DEFAULT_INTERVAL as PRUNE_INTERVAL

    assert arguments.DEFAULTS == {
        "equinix_api_url": DEFAULT_API_URL,
        "metrics_fleet_period": DEFAULT_FLEET_PERIOD,
        "recovery_first_heartbeat_timeout": AGENT_FIRST_HEARTBEAT_TIMEOUT,
        "recovery_heartbeat_timeout": AGENT_HEARTBEAT_TIMEOUT,
        "approve_interval": APPROVE_INTERVAL,
    }
    assert arguments.PRUNE_INTERVAL == PRUNE_INTERVAL
    args = arguments.build_parser().parse_args(
        ["--bmdb-url", "u", "--provider", "static", "--ssh-key-path", "k", "--agent-endpoint", "e"]
    )
    assert {name: getattr(args, name) for name in arguments.DEFAULTS} == arguments.DEFAULTS
