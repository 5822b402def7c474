"""``python -m bmdb`` with a malformed URL that holds a password: one line on
stderr, no traceback, and the password nowhere in the output."""

from __future__ import annotations

import sys

import pytest
import trio

PASSWORD = "s3cret-pw"

#: Malformed libpq URLs and key/value strings, each holding `PASSWORD`.
BAD_URLS = [
    # libpq quotes the whole URI in its complaint.
    f"postgresql://bob:{PASSWORD}@[::1/db",
    f"postgresql://bob:{PASSWORD}@127.0.0.1:notaport/db",
    f"postgresql://bob:{PASSWORD}@127.0.0.1/db?no_such_option=1",
    f"host=127.0.0.1 password={PASSWORD} dbname",
]


def assert_one_clean_line(code: int, out: str, err: str) -> None:
    assert code in (1, 2), (code, err)
    assert PASSWORD not in out + err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert "cannot connect to the BMDB" in err


@pytest.mark.parametrize("url", BAD_URLS)
@pytest.mark.parametrize("command", ["machines", "migrate"])
async def test_malformed_url_is_one_line_without_password(url: str, command: str) -> None:
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, "-m", "bmdb", "--url", url, command],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert_one_clean_line(result.returncode, result.stdout.decode(), result.stderr.decode())
    assert result.stdout == b""
