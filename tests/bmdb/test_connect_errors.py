"""Every psycopg error at connect is a one-line `DatabaseUnavailable` that
never shows the password, however the URL is broken."""

from __future__ import annotations

import traceback

import pytest

from bmdb._pg import PgConnection
from bmdb.errors import DatabaseUnavailable


@pytest.mark.parametrize(
    ("conninfo", "secrets"),
    [
        # Malformed: libpq quotes the URI.
        ("postgresql://bob:s3cret-pw@[::1/db", ["s3cret-pw"]),
        # Percent-encoded password, malformed URI quoted as written.
        ("postgresql://bob:s3cret%2Fpw@[::1/db", ["s3cret%2Fpw", "s3cret/pw"]),
        # A raw "@" in the password: the host read is a piece of it.
        ("postgresql://bob:p4@ssw0rd@no-such-host.invalid/db", ["ssw0rd"]),
        # Unknown option, bad port, broken key/value syntax.
        ("postgresql://bob:s3cret-pw@127.0.0.1/db?no_such_option=1", ["s3cret-pw"]),
        ("postgresql://bob:s3cret-pw@127.0.0.1:notaport/db", ["s3cret-pw"]),
        ("host=127.0.0.1 password='s3cret pw' dbname", ["s3cret pw"]),
        # Well formed, nothing listening: psycopg explains on two lines.
        ("postgresql://bob:s3cret-pw@127.0.0.1:1/db", ["s3cret-pw"]),
    ],
)
async def test_connect_error_is_one_line_without_password(
    conninfo: str, secrets: list[str]
) -> None:
    with pytest.raises(DatabaseUnavailable) as caught:
        await PgConnection.connect(conninfo)
    message = str(caught.value)
    assert message.startswith("cannot connect to the BMDB: ")
    assert "\n" not in message
    # Nor in what a log record with exc_info would show.
    shown = "".join(traceback.format_exception(caught.value))
    for secret in secrets:
        assert secret not in shown
