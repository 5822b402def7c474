"""The BMDB's exceptions, one hierarchy rooted at `BMDBError`.

::

    BMDBError
    ├── InvalidArgument          (also a ValueError) bad input, nothing was written
    ├── DatabaseUnavailable      cannot connect, or the connection was lost
    │   └── CommitOutcomeUnknown a COMMIT that may or may not have happened
    ├── PermissionDenied         the database role lacks a privilege (which one, and for what)
    ├── SchemaError              the database schema does not match this code
    │   ├── SchemaTooNew         migrated by a newer release than this one
    │   ├── SchemaNotMigrated    migrations missing (run `python -m bmdb migrate`)
    │   └── SchemaConflict       holds an object of ours that bmdb migrations did not create
    ├── SessionExpired           the session is gone; start a new one
    ├── TransactionFailed        retries of serialization failures exhausted
    ├── NothingToDo              a work source found no machine
    ├── WorkConflict             the sourced machine is already being worked on
    ├── WorkClosed               finish/fail on work that was already closed
    └── LocalPostgresError       bmdb.localserver: the local server did not start

`NothingToDo` is also what a work source raises to say it found nothing; it
is an expected outcome rather than a failure, and callers usually wait and
try again.

Database errors never escape as psycopg's own: the transaction layer and
the migrations translate them by one rule (`bmdb.pgerrors.as_bmdb_error`, by
SQLSTATE), into messages of one line that name the object and say what to
do. Other exceptions a
public function may raise are Python's own, for misuse (`ValueError` for a
bad argument, `RuntimeError` for a closed pool), and Trio's
`trio.Cancelled`. ``tests/test_error_trees.py`` checks the tree and what
public functions raise.
"""

from __future__ import annotations


class BMDBError(Exception):
    """Base class of every error raised by the `bmdb` package."""


class InvalidArgument(BMDBError, ValueError):
    """The caller passed a value the BMDB cannot accept. Nothing was written."""


class DatabaseUnavailable(BMDBError):
    """The database cannot be reached, or the connection to it was lost."""


class CommitOutcomeUnknown(DatabaseUnavailable):
    """A ``COMMIT`` whose outcome is unknown: it did not return within its
    bound (the connection was dropped), or the server it reached committed
    without its synchronous standby confirming it (a failover may lose it).
    It may or may not have happened; callers treat it as a lost connection."""


class PermissionDenied(BMDBError):
    """The role the BMDB connects as may not do what was asked; the message
    names the role and the privilege to grant."""


class SchemaError(BMDBError):
    """The database schema is not the one this code was written for."""


class SchemaTooNew(SchemaError):
    """The database was migrated by a newer release; refuse to touch it."""


class SchemaNotMigrated(SchemaError):
    """The database lacks migrations this code needs."""


class SchemaConflict(SchemaError):
    """The database holds an object of the BMDB's schema (a ``machines``
    table, a ``provider`` type, ``schema_migrations`` itself) that bmdb
    migrations did not create: another application's, most likely. Nothing
    was changed; the BMDB needs an empty database or schema."""


class SessionExpired(BMDBError):
    """The session passed its deadline (or was deleted) and cannot be used.

    Everything that ran under the session has been cancelled; start a new
    session to continue.
    """


class TransactionFailed(BMDBError):
    """A transaction kept failing to serialize and ran out of retries."""


class NothingToDo(BMDBError):
    """A work source found no machine to work on."""


class WorkConflict(BMDBError):
    """The sourced machine already has live work for this process."""


class WorkClosed(BMDBError):
    """The work was already finished, failed or canceled."""
