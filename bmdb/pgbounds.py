"""How long a BMDB statement and commit may take (`Bounds`), and the
connect-time ``statement_timeout`` that puts the statement's on the server.

See `bmdb._pg`'s docstring for what happens when a bound passes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

__all__ = [
    "COMMIT_TIMEOUT",
    "STATEMENT_GRACE",
    "STATEMENT_TIMEOUT",
    "UNBOUNDED",
    "Bounds",
    "with_statement_timeout",
]

#: Default server-side bound on one statement (``statement_timeout``), seconds.
STATEMENT_TIMEOUT = 30.0
#: Seconds the client waits past ``statement_timeout`` for an answer before
#: it takes the server for gone.
STATEMENT_GRACE = 5.0
#: Default client-side bound on one ``COMMIT``, seconds (module docstring).
COMMIT_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class Bounds:
    """How long one statement and one commit may take, in seconds (None: no
    bound). See the module docstring; `bmdb.open_connection` takes one."""

    statement: float | None = STATEMENT_TIMEOUT
    commit: float | None = COMMIT_TIMEOUT

    def __post_init__(self) -> None:
        for name in ("statement", "commit"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"the {name} bound must be positive or None, got {value!r}")


#: No bound at all: migrations (an index built over a large fleet) and tools.
UNBOUNDED = Bounds(statement=None, commit=None)


def with_statement_timeout(conninfo: str, seconds: float | None) -> dict[str, Any]:
    """The ``options`` keyword that sets ``statement_timeout`` at connect,
    keeping what ``conninfo`` (or ``PGOPTIONS``) already says; none when
    there is no bound, when they set one already, or when ``conninfo`` does
    not parse (connect then reports it)."""
    if seconds is None:
        return {}
    try:
        options = conninfo_to_dict(conninfo).get("options")
    except psycopg.Error:
        return {}
    existing = str(options) if options is not None else os.environ.get("PGOPTIONS", "")
    if "statement_timeout" in existing:
        return {}
    setting = f"-c statement_timeout={max(1, round(seconds * 1000))}"
    return {"options": f"{existing} {setting}".strip()}
