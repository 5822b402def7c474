"""The per-machine takeover step on its own: response checks, and SSH-side failures."""

from __future__ import annotations

import contextlib
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.agent_bundle import agent_zipapp
from shepherd.agent_start import (
    MAX_WARNINGS,
    AgentConfig,
    AgentError,
    BadKeyLength,
    EchoMismatch,
    MalformedResponse,
    TakeoverFailed,
    UploadFailed,
    parse_response,
    start_agent,
)
from shepherd.localsshd import Sshd
from shepherd.proto.agent import TakeoverError, TakeoverInit, TakeoverResponse, TakeoverSuccess
from shepherd.providers import Machine
from shepherd.ssh import SSHClient
from shepherd.ssh_key import SSHKey
from tests.shepherd.agents import patched_agent

SENT = TakeoverInit(machine_id="m-1", bmaas_endpoint="e:443", ca_certificate=b"\x30\x00")
SENT_BYTES = bytes(SENT)
KEY = bytes(32)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (payloads here are shorter than 128 bytes)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def _success(init: TakeoverInit = SENT, key: bytes = bytes(32)) -> bytes:
    return bytes(TakeoverResponse(success=TakeoverSuccess(init_message=init, key=key)))


def test_good_response_gives_key_and_warnings() -> None:
    response = TakeoverResponse(
        success=TakeoverSuccess(init_message=SENT, key=b"k" * 32, warning=["w1", "w2"])
    )
    assert parse_response(bytes(response), SENT) == (b"k" * 32, ["w1", "w2"])


@pytest.mark.parametrize(
    ("stdout", "error", "message"),
    [
        (b"", MalformedResponse, "agent wrote nothing to stdout"),
        (b"hello", MalformedResponse, "not a TakeoverResponse"),
        (_success()[:-3], MalformedResponse, "past end of message"),
        (b"\x0a\x03\x0a\x05a", MalformedResponse, "past end of message"),  # nested
        (b"\x08\x01", MalformedResponse, "want length-delimited"),
        (b"\x1a\x00", MalformedResponse, "neither success nor error"),  # unknown field only
        (
            bytes(TakeoverResponse(error=TakeoverError(message="disk on fire"))),
            AgentError,
            "agent returned error: disk on fire",
        ),
        (_success(TakeoverInit(machine_id="m-2", bmaas_endpoint="e:443")), EchoMismatch, "m-2"),
        (_success(TakeoverInit()), EchoMismatch, "did not echo"),
        (_success(key=bytes(31)), BadKeyLength, "31 bytes, want 32"),
        (_success(key=b""), BadKeyLength, "0 bytes, want 32"),
        # A hostile agent: both oneof members set, in either order.
        (
            _success() + bytes(TakeoverResponse(error=TakeoverError(message="x"))),
            MalformedResponse,
            "more than one of result set: success, error",
        ),
        (
            bytes(TakeoverResponse(error=TakeoverError(message="x"))) + _success(),
            MalformedResponse,
            "more than one of result set: error, success",
        ),
        # Fields of the wrong wire type, at every level.
        (_field(1, _field(1, SENT_BYTES) + b"\x10\x05"), MalformedResponse, "field 2: wire type 0"),
        (_field(1, _field(1, SENT_BYTES) + b"\x18\x05"), MalformedResponse, "field 3: wire type 0"),
        (_field(1, b"\x08\x01"), MalformedResponse, "field 1: wire type 0"),
        (_field(1, _field(1, b"\x08\x01")), MalformedResponse, "field 1: wire type 0"),
        (_field(2, b"\x08\x01"), MalformedResponse, "field 1: wire type 0"),
        (_field(2, _field(1, b"\xff")), MalformedResponse, "not UTF-8"),
        (_field(1, _field(1, SENT_BYTES) + _field(3, b"\xff")), MalformedResponse, "not UTF-8"),
        # A singular field given twice (a parser taking the last would be fooled).
        (_field(1, _field(2, KEY) + _field(2, KEY)), MalformedResponse, "key, field 2: set twice"),
    ],
)
def test_bad_responses_say_what_is_wrong(
    stdout: bytes, error: type[TakeoverFailed], message: str
) -> None:
    with pytest.raises(error, match=message) as caught:
        parse_response(stdout, SENT, b"host key")
    assert caught.value.host_key == b"host key"


def test_agent_config_refuses_missing_pieces() -> None:
    good = {
        "executable": b"x",
        "target_path": "/root/agent",
        "endpoint": "e:443",
        "endpoint_ca_certificate": b"",
        "ssh_connect_timeout": 2.0,
        "ssh_exec_timeout": 60.0,
    }
    for field, bad, message in [
        ("executable", b"", "executable not configured"),
        ("target_path", "", "target path must be set"),
        ("target_path", "agent", "target path must be absolute, got 'agent'"),
        ("target_path", "~/agent", "target path must be absolute"),
        ("endpoint", "", "endpoint must be set"),
        ("ssh_connect_timeout", 0.0, "connect timeout must be positive"),
        ("ssh_exec_timeout", -1.0, "exec timeout must be positive"),
    ]:
        with pytest.raises(ValueError, match=message):
            AgentConfig(**{**good, field: bad})  # type: ignore[arg-type]


def test_install_bounds_reach_the_agents_settings() -> None:
    """The download bounds of AgentConfig are flags of the agent's command
    line, which the agent turns into its install settings."""
    import shlex

    from shepherd.agent.__main__ import _install_settings, parse_args
    from shepherd.agent.gpt import Layout
    from shepherd.agent.install import Settings

    config = AgentConfig(
        executable=b"x",
        target_path="/root/agent",
        endpoint="e:443",
        endpoint_ca_certificate=b"",
        ssh_connect_timeout=2.0,
        ssh_exec_timeout=60.0,
        heartbeat_interval=0.5,
        install_download_deadline=3.0,
        install_backoff_start=0.25,
        install_backoff_cap=0.8,
    )
    argv = shlex.split(config.command())
    assert argv[0] == "/root/agent"
    options = parse_args(argv[1:])
    assert (options.interval, options.cap) == (0.5, 60.0)
    assert not options.systemd_unit
    settings = _install_settings(Settings(), options)
    assert (settings.download_deadline, settings.backoff_start, settings.backoff_cap) == (
        3.0,
        0.25,
        0.8,
    )
    assert settings.max_image_bytes == Settings().max_image_bytes  # the rest: defaults
    # Unset, the agent is not told: its own defaults hold.
    plain = AgentConfig(**{**config.__dict__, "install_download_deadline": None})
    assert "--install-download-deadline" not in plain.command()
    assert _install_settings(Settings(), parse_args([])) == Settings()
    # A real disk's layout, what follows an install, and the unit.
    real = AgentConfig(
        **{
            **config.__dict__,
            "install_layout": (4, 24, 160),
            "install_after": "reboot",
            "systemd_unit": True,
        }
    )
    options = parse_args(shlex.split(real.command())[1:])
    assert options.systemd_unit
    settings = _install_settings(Settings(), options)
    assert settings.layout == Layout(boot_mib=4, system_mib=24, data_min_mib=160)
    assert settings.after_install == "reboot"
    # The unit passes on every flag but its own.
    assert "--systemd-unit" not in options.unit_flags
    assert parse_args(options.unit_flags).layout == (4, 24, 160)


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_install_bounds_must_be_positive(value: float) -> None:
    from shepherd.agent.__main__ import parse_args
    from shepherd.agent.errors import AgentError

    good = {
        "executable": b"x",
        "target_path": "/root/agent",
        "endpoint": "e:443",
        "endpoint_ca_certificate": b"",
        "ssh_connect_timeout": 2.0,
        "ssh_exec_timeout": 60.0,
    }
    with pytest.raises(ValueError, match="install-backoff-cap must be positive"):
        AgentConfig(**good, install_backoff_cap=value)  # type: ignore[arg-type]
    with pytest.raises(AgentError, match="must be positive"):
        parse_args(["--install-backoff-start", repr(value)])
    with pytest.raises(AgentError, match="usage"):
        parse_args(["--install-nonsense", "1"])


async def test_upload_failure_is_its_own_cause(
    aio_loop: object, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    config = AgentConfig(
        executable=agent_zipapp(),
        target_path=str(sshd.root / "no-such-dir" / "agent"),
        endpoint="e:443",
        endpoint_ca_certificate=b"",
        ssh_connect_timeout=5.0,
        ssh_exec_timeout=30.0,
    )
    client = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    machine = Machine("m-1", sshd.host, sshd.port)
    with pytest.raises(UploadFailed, match=r"agent upload failed: .*SFTP: No such file") as caught:
        await start_agent(client, machine, uuid.uuid4(), config, known_host_key=None)
    assert caught.value.host_key == sshd.host_key


async def test_agent_gets_the_init_message_on_stdin(
    aio_loop: object, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    """The bytes on the agent's stdin are TakeoverInit{machine_id, endpoint, CA DER}.

    (The echo check cannot show this: an agent echoes whatever it was sent.)
    """
    target = sshd.root / "agent"
    config = AgentConfig(
        executable=b'#!/bin/sh\ncat > "$0.stdin"\n',
        target_path=str(target),
        endpoint="bmaas.example:443",
        endpoint_ca_certificate=b"\x30\x82 CA DER",
        ssh_connect_timeout=5.0,
        ssh_exec_timeout=30.0,
    )
    client = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    machine_id = uuid.uuid4()
    with pytest.raises(MalformedResponse, match="wrote nothing"):
        await start_agent(
            client, Machine("m-1", sshd.host, sshd.port), machine_id, config, known_host_key=None
        )
    received = TakeoverInit.parse((sshd.root / "agent.stdin").read_bytes())
    assert received == TakeoverInit(
        machine_id=str(machine_id),
        bmaas_endpoint="bmaas.example:443",
        ca_certificate=b"\x30\x82 CA DER",
    )


async def test_start_agent_returns_key_and_host_key(
    aio_loop: object, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    config = AgentConfig(
        executable=agent_zipapp(),
        target_path=str(sshd.root / "agent"),
        endpoint="e:443",
        endpoint_ca_certificate=b"",
        ssh_connect_timeout=5.0,
        ssh_exec_timeout=30.0,
    )
    client = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    machine = Machine("m-1", sshd.host, sshd.port)
    first = await start_agent(client, machine, uuid.uuid4(), config, known_host_key=None)
    again = await start_agent(client, machine, uuid.uuid4(), config, known_host_key=first.host_key)
    assert first.host_key == sshd.host_key
    assert len(first.key) == 32
    # The agent keeps its key across runs: the machine's identity is stable.
    assert again.key == first.key
    assert first.warnings == again.warnings == []


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_any_bytes_parse_or_fail_cleanly(stdout: bytes) -> None:
    """Whatever a machine prints, the parser returns or raises TakeoverFailed."""
    try:
        key, warnings = parse_response(stdout, SENT)
    except TakeoverFailed:
        return
    assert len(key) == 32 and all(isinstance(w, str) for w in warnings)


# Messages built from protobuf-shaped pieces reach deeper than random bytes.
_fields = st.recursive(
    st.tuples(st.integers(1, 4), st.integers(0, 300)).map(
        lambda nv: bytes([nv[0] << 3]) + bytes([nv[1] & 0x7F])
    )
    | st.binary(max_size=40).map(lambda b: _field(1, b))
    | st.just(_field(1, bytes(SENT)))
    | st.just(_field(2, bytes(32))),
    lambda inner: st.tuples(st.integers(1, 3), st.lists(inner, max_size=4)).map(
        lambda nf: _field(nf[0], b"".join(nf[1])[:127])
    ),
    max_leaves=12,
)


@settings(max_examples=500, deadline=None)
@given(st.lists(_fields, max_size=4).map(b"".join))
def test_fuzz_structured_replies_parse_or_fail_cleanly(stdout: bytes) -> None:
    with contextlib.suppress(TakeoverFailed):
        parse_response(stdout, SENT)


async def test_agent_warnings_are_capped(
    aio_loop: object, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    flood = patched_agent(
        "__main__.py",
        b"encode_success(init_bytes, ed25519_public_key(seed), warnings)",
        b"encode_success(init_bytes, ed25519_public_key(seed), ['w\\x1b[2J'] * 5000)",
    )
    config = AgentConfig(
        executable=flood,
        target_path=str(sshd.root / "agent"),
        endpoint="e:443",
        endpoint_ca_certificate=b"",
        ssh_connect_timeout=5.0,
        ssh_exec_timeout=30.0,
    )
    client = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    machine = Machine("m-1", sshd.host, sshd.port)
    started = await start_agent(client, machine, uuid.uuid4(), config, known_host_key=None)
    assert len(started.warnings) == MAX_WARNINGS + 1
    assert started.warnings[-1] == f"({5000 - MAX_WARNINGS} more warnings not shown)"
