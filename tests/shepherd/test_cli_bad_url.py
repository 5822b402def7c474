"""``python -m shepherd`` with a malformed BMDB URL that holds a password: one
line on stderr, no traceback, and the password nowhere in the output."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio

from shepherd.ssh_key import SSHKey
from tests.bmdb.test_cli_bad_url import BAD_URLS, assert_one_clean_line


@pytest.mark.parametrize("url", BAD_URLS)
async def test_malformed_bmdb_url_is_one_line_without_password(url: str, tmp_path: Path) -> None:
    machines = tmp_path / "machines.toml"
    machines.write_text('[[machine]]\nid = "m-1"\naddress = "127.0.0.1"\n')
    # An existing key: generating one is logged (the operator must learn of
    # a new key), and that line is not what this test is about.
    key = tmp_path / "id_ed25519"
    key.write_bytes(SSHKey.generate().openssh_private)
    key.chmod(0o600)
    argv = [
        sys.executable,
        "-m",
        "shepherd",
        "--bmdb-url",
        url,
        "--provider",
        "static",
        "--static-machines-path",
        str(machines),
        "--ssh-key-path",
        str(tmp_path / "id_ed25519"),
        "--agent-endpoint",
        "bmaas.example:443",
    ]
    with trio.fail_after(60):
        result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert_one_clean_line(result.returncode, result.stdout.decode(), result.stderr.decode())
