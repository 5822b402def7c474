"""psycopg's errors read for the BMDB: which may be retried, and the one rule
(`as_bmdb_error`, by SQLSTATE) that turns a server's error into a `BMDBError`;
one-line messages without the password."""

from __future__ import annotations

import re
import urllib.parse

import psycopg
import psycopg.errors
from psycopg.conninfo import conninfo_to_dict

from bmdb.errors import (
    BMDBError,
    DatabaseUnavailable,
    InvalidArgument,
    PermissionDenied,
    SchemaConflict,
    SchemaNotMigrated,
)
from common.text import printable

__all__ = [
    "as_bmdb_error",
    "error_message",
    "first_line",
    "is_bad_data",
    "is_database_error",
    "is_retryable",
    "is_undefined_object",
    "one_line",
    "without_password",
]


def is_retryable(e: BaseException) -> bool:
    """True for serialization failures and deadlocks: the transaction can be
    run again from the start and may then succeed."""
    return isinstance(e, psycopg.errors.SerializationFailure | psycopg.errors.DeadlockDetected)


def is_undefined_object(e: BaseException) -> bool:
    """True if the server does not know a table, type or function we used."""
    return isinstance(
        e,
        psycopg.errors.UndefinedTable
        | psycopg.errors.UndefinedObject
        | psycopg.errors.UndefinedFunction
        | psycopg.errors.UndefinedColumn,
    )


def is_bad_data(e: BaseException) -> bool:
    """True for errors caused by the values a statement was given (constraint
    violations, malformed input)."""
    return isinstance(e, psycopg.errors.IntegrityError | psycopg.errors.DataError)


def is_database_error(e: BaseException) -> bool:
    """True for any error reported by psycopg."""
    return isinstance(e, psycopg.Error)


#: What a server error means to an operator, by SQLSTATE: the full code, or
#: a prefix of it (the first two characters are its class). The BMDB error
#: to raise, and its message: ``{message}`` is the server's, ``{role}`` the
#: role connected. Codes not listed become a plain `BMDBError`.
_BY_SQLSTATE: dict[str, tuple[type[BMDBError], str]] = {
    # duplicate_table, duplicate_object (types, triggers), duplicate_function:
    # the BMDB creates objects only in its migrations.
    **dict.fromkeys(
        ("42P07", "42710", "42723"),
        (
            SchemaConflict,
            "{message}, and bmdb migrations did not create it:"
            " use an empty database or schema for the BMDB",
        ),
    ),
    "42501": (
        PermissionDenied,
        "{message}: grant {role} that privilege, or connect as a role that holds it",
    ),
    "25006": (BMDBError, "{message}: the server is read-only (a standby?); use the primary"),
    "3D000": (DatabaseUnavailable, "{message}: create the database, or fix its name"),
    "28": (DatabaseUnavailable, "{message}: check the user name and password"),
    "08": (DatabaseUnavailable, "lost the BMDB connection: {message}"),
    "57P": (DatabaseUnavailable, "{message}: the server is shutting down or restarting"),
    "53": (BMDBError, "{message}: the server is out of disk, memory or connections"),
    "55P03": (BMDBError, "{message}: another transaction holds the lock; try again"),
    "57014": (BMDBError, "{message} (statement_timeout or an operator's cancel)"),
}


def as_bmdb_error(
    e: BaseException, *, role: str | None = None, doing: str | None = None
) -> BaseException | None:
    """The one rule for what a psycopg error means to BMDB callers.

    `BMDBError`s are returned as they are; constraint violations and
    malformed values become `InvalidArgument`, unknown tables or types
    `SchemaNotMigrated`; other server errors are read by SQLSTATE
    (`_BY_SQLSTATE`: an object that exists already is a `SchemaConflict`, a
    missing privilege `PermissionDenied` naming ``role``, a lost server
    `DatabaseUnavailable`), the rest become a plain `BMDBError`. Each
    message is one line: ``doing`` (what was being done, e.g. a
    migration's name), the server's message, escaped
    (`common.text.printable`: it quotes names from the database), and what
    to do. Serialization failures and deadlocks (retried by the transaction
    layer) and non-database exceptions give None.
    """
    if isinstance(e, BMDBError):
        return e
    if is_retryable(e) or not is_database_error(e):
        return None
    kind, text = _classify(e, role)
    return kind(f"{doing}: {text}" if doing else text)


def _classify(e: BaseException, role: str | None) -> tuple[type[BMDBError], str]:
    """The BMDB error class for server error ``e``, and its message."""
    message = printable(error_message(e))
    if is_bad_data(e):
        return InvalidArgument, message
    if is_undefined_object(e):
        return SchemaNotMigrated, f"{message}: run `python -m bmdb migrate`"
    sqlstate = getattr(e, "sqlstate", None) or ""
    for prefix in (sqlstate, sqlstate[:3], sqlstate[:2]):
        if prefix and prefix in _BY_SQLSTATE:
            kind, template = _BY_SQLSTATE[prefix]
            who = f"role {printable(role)}" if role else "the role the BMDB connects as"
            return kind, template.format(message=message, role=who)
    suffix = f" (SQLSTATE {sqlstate})" if sqlstate else ""
    return BMDBError, f"database error: {message}{suffix}"


def error_message(e: BaseException) -> str:
    """The server's primary message of a psycopg error, else ``str(e)``."""
    if isinstance(e, psycopg.Error) and e.diag.message_primary:
        return e.diag.message_primary
    return first_line(e)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def one_line(e: BaseException) -> str:
    """All of ``str(e)`` on one line (libpq explains on indented lines)."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return text or type(e).__name__


#: A password in a key/value conninfo: ``password=x`` or ``password='x y'``.
_KV_PASSWORD = re.compile(r"password\s*=\s*('(?:[^'\\]|\\.)*'|\S+)")
#: A quoted span in an error message (libpq uses "", psycopg '').
_QUOTED = re.compile(r'"[^"]*"|\'[^\']*\'')


def _passwords(conninfo: str) -> set[str]:
    """Every spelling of the password that ``conninfo`` may contain, also
    when it is too malformed to parse (then by a looser reading)."""
    found: set[str] = set()
    try:
        password = conninfo_to_dict(conninfo).get("password")
    except psycopg.Error:
        password = None
    if isinstance(password, str):
        found.add(password)
    _, sep, rest = conninfo.partition("://")
    if sep and "@" in rest:
        # libpq ends the userinfo at the first "@"; a password holding a raw
        # "@" runs to the last.
        for userinfo in (rest.split("@", 1)[0], rest.rsplit("@", 1)[0]):
            _, colon, secret = userinfo.partition(":")
            if colon:
                found.update((secret, urllib.parse.unquote(secret)))
    for match in _KV_PASSWORD.finditer(conninfo):
        value = match.group(1)
        found.update((value, value.strip("'")))
    return {p for p in found if p}


def without_password(text: str, conninfo: str) -> str:
    """``text`` with the password of ``conninfo`` replaced by ``***``, and
    every quoted span that shares a piece of it too (libpq and psycopg quote
    the parts of a malformed URL they could not read, which may cut the
    password: ``bob:p@ss@host`` reads as host ``ss@host``)."""
    passwords = _passwords(conninfo)
    if not passwords:
        return text

    def shares_a_piece(inner: str, password: str) -> bool:
        if inner in password:
            return True
        return any(password[i : i + 3] in inner for i in range(len(password) - 2))

    def whole(text: str) -> str:
        for password in sorted(passwords, key=len, reverse=True):
            text = text.replace(password, "***")
        return text

    def quoted(match: re.Match[str]) -> str:
        quote, inner = match.group()[0], whole(match.group()[1:-1])
        if inner and any(shares_a_piece(inner, p) for p in passwords):
            inner = "***"
        return quote + inner + quote

    return whole(_QUOTED.sub(quoted, text))
