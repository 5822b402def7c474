"""``python -m shepherd --provider equinix``: options, and real runs against the local API."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import bmdb
from bmdb import Provider, Queries
from shepherd.cli import parse_options
from shepherd.providers.equinix.localserver import Fault, LocalEquinix
from shepherd.providers.equinix.provider import EquinixProvider

PROJECT = "11111111-1111-4111-8111-111111111111"


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--bmdb-url",
        "postgresql:///bmdb",
        "--provider",
        "equinix",
        "--ssh-key-path",
        str(tmp_path / "id_ed25519"),
        "--agent-endpoint",
        "bmaas.example:443",
        *extra,
    ]


GOOD = (
    "--equinix-project-id",
    PROJECT,
    "--equinix-ssh-key-label",
    "shepherd-prod",
    "--equinix-device-prefix",
    "shepherd-prod-",
    "--equinix-api-token",
    "t0ken",
)


def test_equinix_options(tmp_path: Path) -> None:
    options = parse_options(
        _argv(tmp_path, *GOOD, "--provisioner-max-machines", "0", "--no-updater-enable")
    )
    assert isinstance(options.provider, EquinixProvider)
    assert options.provider.config.project_id == PROJECT
    assert options.provisioner.max_machines == 0
    assert options.provisioner.chunk_size == 20
    assert options.provisioner.creation_rate.interval == 5.0
    assert options.provisioner.reconciler_rate.interval == 60.0
    assert options.updater is None


@pytest.mark.parametrize(
    ("drop", "value", "error"),
    [
        ("--equinix-ssh-key-label", None, "'shepherd-FIXME' still contains FIXME"),
        ("--equinix-device-prefix", None, "'shepherd-FIXME-' still contains FIXME"),
        ("--equinix-project-id", None, "--equinix-project-id must be set"),
        ("--equinix-project-id", "my-project", "'my-project' is not a project UUID"),
        ("--equinix-api-token", None, "--equinix-api-token or METAL_AUTH_TOKEN must be set"),
    ],
)
def test_bad_equinix_options_are_refused_before_anything_starts(
    tmp_path: Path,
    drop: str,
    value: str | None,
    error: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("METAL_AUTH_TOKEN", raising=False)
    argv = list(GOOD)
    at = argv.index(drop)
    if value is None:
        del argv[at : at + 2]
    else:
        argv[at + 1] = value
    with pytest.raises(SystemExit) as exited:
        parse_options(_argv(tmp_path, *argv))
    assert exited.value.code == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "id_ed25519").exists()  # nothing written


async def _run_shepherd(argv: list[str], log: Path) -> trio.Process:
    with log.open("wb") as out:
        return await trio.lowlevel.open_process(
            [sys.executable, "-m", "shepherd", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "METAL_AUTH_TOKEN": ""},
        )


async def test_python_m_shepherd_equinix_provisions_and_stops_on_sigterm(
    bmdb_conn: bmdb.Connection, bmdb_url: str, equinix: LocalEquinix, tmp_path: Path
) -> None:
    equinix.add_reservations(3)
    argv = [
        "--bmdb-url",
        bmdb_url,
        "--provider",
        "equinix",
        "--ssh-key-path",
        str(tmp_path / "id_ed25519"),
        "--agent-endpoint",
        "bmaas.example:443",
        "--equinix-api-url",
        equinix.url,
        "--equinix-api-token",
        equinix.token,
        "--equinix-project-id",
        equinix.project_id,
        "--equinix-ssh-key-label",
        "shepherd-cli",
        "--equinix-device-prefix",
        "shepherd-cli-",
        "--provisioner-max-machines",
        "2",
        "--provisioner-device-creation-rate",
        "10ms,1",
        "--updater-iteration-rate",
        "100ms",
    ]
    log = tmp_path / "shepherd.log"
    process = await _run_shepherd(argv, log)

    async def recorded(q: Queries) -> int:
        return len(await q.provided_by_provider(Provider.EQUINIX))

    try:
        with trio.fail_after(60):
            while await bmdb_conn.transact(recorded) < 2:  # noqa: ASYNC110 (state in Postgres)
                await trio.sleep(0.05)
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert len(equinix.devices) == 2
    assert [k["label"] for k in equinix.ssh_keys.values()] == ["shepherd-cli"]
    assert "got SIGTERM, stopping" in log.read_text()


async def test_sigkill_after_device_creation_makes_no_second_device_on_restart(
    bmdb_conn: bmdb.Connection, bmdb_url: str, equinix: LocalEquinix, tmp_path: Path
) -> None:
    equinix.add_reservations(2)
    # The API creates the device, then sits on the answer: the Shepherd is
    # killed knowing nothing of it, before any BMDB write.
    devices = f"/projects/{equinix.project_id}/devices"
    equinix.inject("POST", devices, Fault(delay=600, after=True))
    argv = [
        "--bmdb-url",
        bmdb_url,
        "--provider",
        "equinix",
        "--ssh-key-path",
        str(tmp_path / "id_ed25519"),
        "--agent-endpoint",
        "bmaas.example:443",
        "--equinix-api-url",
        equinix.url,
        "--equinix-api-token",
        equinix.token,
        "--equinix-project-id",
        equinix.project_id,
        "--equinix-ssh-key-label",
        "shepherd-cli",
        "--equinix-device-prefix",
        "shepherd-cli-",
        "--provisioner-max-machines",
        "1",
        "--provisioner-reconciler-rate",
        "100ms,1",
    ]
    first = await _run_shepherd(argv, tmp_path / "first.log")
    try:
        with trio.fail_after(60):
            while not equinix.devices:  # noqa: ASYNC110 (state in the API server)
                await trio.sleep(0.05)
    finally:
        first.kill()
        await first.wait()
    (orphan,) = equinix.devices

    second_log = tmp_path / "second.log"
    second = await _run_shepherd(argv, second_log)
    try:
        with trio.fail_after(60):
            while "provider and BMDB disagree" not in second_log.read_text():  # noqa: ASYNC110
                await trio.sleep(0.05)
            # A few more reconciliations, to be sure none creates anything.
            reconciled = len(equinix.requests)
            while len(equinix.requests) < reconciled + 10:  # noqa: ASYNC110
                await trio.sleep(0.05)
            second.send_signal(signal.SIGTERM)
            assert await second.wait() == 0
    finally:
        if second.returncode is None:
            second.kill()
            await second.wait()

    async def recorded(q: Queries) -> int:
        return len(await q.provided_by_provider(Provider.EQUINIX))

    assert list(equinix.devices) == [orphan]
    assert await bmdb_conn.transact(recorded) == 0
    text = second_log.read_text()
    assert f"Equinix machine {orphan} is at the provider but not in the BMDB" in text
    posts = [r for r in equinix.requests if r.method == "POST" and r.path == devices]
    assert posts == []  # the first POST never answered; the restart sent none


async def test_python_m_shepherd_equinix_unknown_project_exits_with_the_api_message(
    bmdb_url: str, equinix: LocalEquinix, tmp_path: Path
) -> None:
    argv = [
        "--bmdb-url",
        bmdb_url,
        "--provider",
        "equinix",
        "--ssh-key-path",
        str(tmp_path / "id_ed25519"),
        "--agent-endpoint",
        "bmaas.example:443",
        "--equinix-api-url",
        equinix.url,
        "--equinix-api-token",
        equinix.token,
        "--equinix-project-id",
        PROJECT,
        "--equinix-ssh-key-label",
        "shepherd-cli",
        "--equinix-device-prefix",
        "shepherd-cli-",
    ]
    log = tmp_path / "shepherd.log"
    process = await _run_shepherd(argv, log)
    try:
        with trio.fail_after(60):
            assert await process.wait() == 1
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert f"shepherd: Equinix: GET /projects/{PROJECT}/ssh-keys: 404: Not found" in log.read_text()
    assert equinix.devices == {} and equinix.ssh_keys == {}
