"""``metropolis owner ... --keep-open SECONDS``: a session process answers
later calls with the same options, as the same call in a process of its
own would (`metropolis.cli.ownerlink`, `metropolis.cli.ownersession`)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from metropolis.__main__ import _parser
from metropolis.cli import ownerlink
from tests.metropolis.test_node_cli import LEADS, bootstrap_args, node
from tests.test_cli_imports import imported

PROJECT = Path(__file__).resolve().parents[2]
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", re.MULTILINE)


@pytest.fixture
def runtime() -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR, short enough for the sockets below it."""
    folder = Path(tempfile.mkdtemp(prefix="ko-"))
    yield folder
    for log in folder.glob("metropolis-owner-*/*.log"):
        _kill_session(log)
    shutil.rmtree(folder, ignore_errors=True)


def _session_pid(log: Path) -> int | None:
    found = re.search(r"\(pid (\d+)\)", log.read_text()) if log.exists() else None
    return int(found.group(1)) if found else None


def _kill_session(log: Path) -> None:
    pid = _session_pid(log)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _run(
    argv: list[str], runtime: Path, cwd: Path | None = None, importtime: bool = False
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "metropolis", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
        # This checkout's code whatever the folder (an editable install may
        # point at another one).
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime), "PYTHONPATH": str(PROJECT)},
    )


def _socket_of(runtime: Path) -> list[Path]:
    return sorted(runtime.glob("metropolis-owner-*/*.sock"))


def _wait(predicate: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _owner_parser() -> argparse.ArgumentParser:
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    owner: argparse.ArgumentParser = commands.choices["owner"]
    return owner


def test_the_scan_knows_the_parser_s_actions_and_options() -> None:
    owner = _owner_parser()
    calls = next(a for a in owner._actions if isinstance(a, argparse._SubParsersAction))
    assert set(calls.choices) == ownerlink.ACTIONS
    valued = {
        s for a in owner._actions if a.nargs is None and a.option_strings for s in a.option_strings
    }
    assert valued - {"-h", "--help"} == ownerlink.VALUE_OPTIONS


def test_the_scan_reads_only_what_it_can_vouch_for() -> None:
    found = ownerlink.scan(
        ["owner", "--root", "nodes", "--owner-key=k", "--keep-open", "5", "nodes"]
    )
    assert found is not None
    assert found.options == (("--root", "nodes"), ("--owner-key", "k"), ("--keep-open", "5"))
    assert found.prefix == ["--root", "nodes", "--owner-key", "k", "--keep-open", "5"]
    for argv in (
        ["owner", "--help"],
        ["owner", "--root", "a", "--root", "b", "nodes"],  # repeated: argparse decides
        ["owner", "--own", "k", "nodes"],  # an abbreviation: argparse decides
        ["owner", "--root", "a"],  # no action
        ["owner", "--root"],
        ["node", "run", "nodes"],
    ):
        assert ownerlink.scan(argv) is None, argv
    # --keep-open is not part of the key; paths are absolute in it.
    here = ownerlink.scan(["owner", "--root", "r", "--owner-key", "k", "nodes"])
    other = ownerlink.scan(["owner", "--keep-open", "9", "--root", os.path.abspath("r"),
                            "--owner-key", "./k", "nodes"])  # fmt: skip
    assert here is not None and other is not None and here.key == other.key
    assert here.key_in("/elsewhere") != here.key


def test_a_folder_others_may_enter_is_never_used(
    runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    found = ownerlink.scan(
        ["owner", "--root", "r", "--owner-key", "k", "--keep-open", "5", "nodes"]
    )
    assert found is not None
    path = ownerlink.session_path(found, create=True)
    assert path is not None
    folder = Path(path).parent
    assert folder.stat().st_mode & 0o777 == 0o700
    folder.chmod(0o755)
    assert ownerlink.session_path(found) is None
    assert (
        ownerlink.forward(["owner", "--root", "r", "--owner-key", "k", "--keep-open", "5", "nodes"])
        is None
    )


def test_a_session_ends_when_idle_survives_garbage_and_gives_way_to_a_newer_one(
    runtime: Path, tmp_path: Path
) -> None:
    """No cluster is needed: the session connects at its first call only.
    Its calls read the owner's files anew: a missing key is the call's
    error, as in a process of its own."""
    options = ["--cluster", str(tmp_path / "cluster.pb"), "--owner-key", str(tmp_path / "k")]
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}

    def session(keep_open: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "metropolis", "owner-session", *options]
        return subprocess.Popen([*argv, "--keep-open", keep_open], env=env)

    first = session("60")
    try:
        _wait(lambda: _socket_of(runtime), "the first session's socket")
        [path] = _socket_of(runtime)
        # Garbage, a request cut short, one too long, another session's
        # call: closed or declined, and the session goes on.
        other = ownerlink.encode_request(
            ["owner", "--root", "/x", "--owner-key", "k", "nodes"], "/"
        )
        answers = {
            b"not a request at all": b"",
            ownerlink.encode_request(["owner"], "/")[:-2]: b"",
            (ownerlink.REQUEST_LIMIT + 1).to_bytes(4, "big") + b"x" * 70000: b"",
            other: ownerlink.encode_frame(b"D", b"not this session's call"),
        }
        for junk, answer in answers.items():
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(str(path))
                sock.sendall(junk)
                sock.shutdown(socket.SHUT_WR)
                try:
                    got = sock.recv(100)
                except ConnectionResetError:  # closed with our bytes unread
                    got = b""
                assert got == answer
        call = _run(["owner", *options, "--keep-open", "60", "nodes"], runtime)
        alone = _run(["owner", *options, "nodes"], runtime)
        assert (call.returncode, call.stdout) == (alone.returncode, alone.stdout) == (2, "")
        assert STAMP.sub("", call.stderr) == STAMP.sub("", alone.stderr)
        assert "cannot read" in call.stderr
        assert first.poll() is None
        # A newer session for the same options takes the path; the older ends.
        second = session("60")
        try:
            first.wait(timeout=30)
            assert _socket_of(runtime) == [path]
            assert second.poll() is None
        finally:
            second.kill()  # leaves its socket behind, as a crash would
            second.wait()
        # A session idle for its --keep-open ends by itself and removes its socket.
        third = session("1")
        try:
            assert third.wait(timeout=30) == 0
            assert _socket_of(runtime) == []
        finally:
            third.kill()
            third.wait()
    finally:
        first.kill()
        first.wait()


async def test_calls_through_a_session_say_what_calls_of_their_own_say(
    runtime: Path, tmp_path: Path
) -> None:
    root, key = tmp_path / "n", tmp_path / "owner.pem"
    options = ["--root", str(root), "--owner-key", str(key)]
    kept = [*options, "--keep-open", "60"]

    def owner(*argv: str, **kw: object) -> subprocess.CompletedProcess[str]:
        return _run(["owner", *argv], runtime, **kw)  # type: ignore[arg-type]

    with trio.fail_after(240):
        async with node(*bootstrap_args(tmp_path)) as first:
            await first.wait_for(LEADS)
            await first.wait_for("status pushed")

            def check() -> None:
                alone = owner(*options, "info")
                assert alone.returncode == 0, alone.stderr
                started = owner(*kept, "info")  # runs here, then starts a session
                assert (started.returncode, started.stdout) == (0, alone.stdout)
                _wait(lambda: _socket_of(runtime), "the session's socket")

                # Served by the session: this process imports no TLS, HTTP/2,
                # protobuf or Trio, and says the same.
                served = owner(*kept, "info", importtime=True)
                assert (served.returncode, served.stdout) == (0, alone.stdout)
                modules = imported(served.stderr)
                assert "metropolis.cli.ownerlink" in modules
                heavy = {"trio", "cryptography", "h2", "betterproto2", "metropolis.owner"}
                assert heavy & modules == set()
                nodes = owner(*kept, "nodes")
                assert nodes.returncode == 0 and "127.0.0.1" in nodes.stdout, nodes.stderr

                # An error: the same line (but its time) and exit code.
                wrong = owner(*kept, "approve", "0123456789abcdef")
                wrong_alone = owner(*options, "approve", "0123456789abcdef")
                assert wrong.returncode == wrong_alone.returncode != 0
                assert STAMP.sub("", wrong.stderr) == STAMP.sub("", wrong_alone.stderr)

                # A usage error is declined: the parser of this process says it.
                usage = owner(*kept, "approve")
                assert usage.returncode == 2 and "usage:" in usage.stderr

                # Relative paths are the caller's: the same session (its key
                # has absolute paths) writes the file in the caller's folder.
                relative = ["--root", "n", "--owner-key", "owner.pem", "--keep-open", "60"]
                out = owner(*relative, "info", "--out", "cluster.pb", cwd=tmp_path)
                assert out.returncode == 0, out.stderr
                assert (tmp_path / "cluster.pb").stat().st_size > 0
                assert len(_socket_of(runtime)) == 1

                # The key is read at each call: gone, the call says so.
                key.rename(tmp_path / "aside.pem")
                gone = owner(*kept, "nodes")
                key.with_name("aside.pem").rename(key)
                assert gone.returncode == 2 and "cannot read the owner key" in gone.stderr

            await trio.to_thread.run_sync(check)
            first.process.send_signal(signal.SIGTERM)


def test_the_caller_runs_the_call_itself_unless_the_session_started_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What the caller makes of a session's answer (`ownerlink._relay`)."""

    def relay(*frames: bytes) -> int | None:
        return ownerlink._relay(io.BytesIO(b"".join(frames)))

    frame = ownerlink.encode_frame
    assert relay(frame(b"S"), frame(b"O", b"a\n"), frame(b"E", b"b\n"), frame(b"X", b"3")) == 3
    assert capsys.readouterr() == ("a\n", "b\n")
    # Declined, or gone before starting: the caller runs it itself.
    assert relay(frame(b"D", b"why")) is None
    assert relay() is None
    assert relay(b"garbage") is None
    assert relay(frame(b"X", b"0")) is None  # an exit before a start is not believed
    # Gone after starting: the outcome is unknown, and said so.
    assert relay(frame(b"S"), frame(b"O", b"half")[:-2]) == 1
    assert "whether the call took effect is unknown" in capsys.readouterr().err
