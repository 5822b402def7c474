"""The one place where the BMDB touches psycopg: its connections, driven by Trio.

psycopg implements the PostgreSQL protocol as generators that say what they
wait for (socket readable, writable) and never block by themselves; its
sync and asyncio connections differ only in the loop that drives those
generators. We drive them with Trio's own I/O waits::

    PgConnection.execute(sql, params)
        PostgresQuery(tx).convert(sql, params)   # psycopg: %(name)s -> $n, dump params
        pgconn.send_query_prepared(...)          # libpq: buffered, no I/O yet
        gen = generators.execute(pgconn)         # psycopg: flush, read the results
        loop: state = gen.send(ready)            # WAIT_R / WAIT_W / WAIT_RW
              ready = await trio.lowlevel.wait_readable / wait_writable(fd)
        rows = tx.load_rows(...)                 # already received, no I/O

Driving libpq at this level (rather than through a psycopg cursor) lets one
round trip carry several messages where the protocol allows it (libpq
pipeline mode): a transaction's BEGIN with its first statement, and a
statement's Parse with its first execution. See `PgConnection.begin`.

Why not psycopg's asyncio connection behind trio-asyncio (the usual way to
use an asyncio library from Trio): a round trip through the bridge costs
several times the CPU of one driven natively (the commit that made the
switch has the figures), and the BMDB's throughput is bounded by exactly
that. The native
loop also needs no asyncio event loop, so the BMDB works with or without
``trio_asyncio.open_loop()``. The price is the use of psycopg's protocol
generators (``psycopg.generators``) and one private class,
``psycopg._queries.PostgresQuery`` (stable across psycopg 3.0-3.3; the
tests exercise them, so an incompatible psycopg fails them loudly).

Cancellation: when the calling Trio scope is cancelled while a statement
runs, `PgConnection.execute` raises a plain `trio.Cancelled` (never an
exception group) once the statement is known not to run on the server any
more, all under a shield, each step with its own bound:

1. If the statement is still being sent (libpq is flushing a message larger
   than the socket buffers), the send is finished first (`ABORT_TIMEOUT`). A
   half-sent message would leave the protocol out of step.
2. Cancel requests go to the server (libpq's ``PQcancelStart`` driven by
   Trio when libpq >= 17, else psycopg's blocking ``cancel`` in a thread),
   repeated at growing intervals (`CANCEL_RETRY`) until the statement's
   result arrives on the connection (the error ``query_canceled``, or its
   normal end), for at most `CANCEL_TIMEOUT`. Repeating is what makes this
   work: the server drops a request that arrives before it has started the
   statement (while it still reads or parses a large one), as "query cancel
   is supposed to be a no-op when there is no query in progress"
   (PostgreSQL's ``postgres.c``); a request that the server answered is not
   one that cancelled anything.
3. If either bound passes, the connection is closed (so `reusable` is false
   and the pool discards it). A backend notices a closed socket only when it
   next reads or writes, so one still running the statement would go on
   (``pg_sleep(600)`` for ten minutes): we connect anew and end it with
   ``pg_terminate_backend``, and wait until it is gone
   (`TERMINATE_TIMEOUT`; if the server refuses, a warning says so).

Without a cancel, nothing of this runs. Opening a connection runs psycopg's
blocking ``connect`` in a worker thread (abandoned, and the connection
discarded, if cancelled).

Bounds (`Bounds`): no statement waits forever, whatever the server does.

- The server ends a statement that runs longer than ``statement`` seconds
  (``statement_timeout``, set at connect unless the URL's ``options`` or
  ``PGOPTIONS`` set one already): SQLSTATE 57014.
- The client gives up on a statement ``STATEMENT_GRACE`` seconds after
  that (a server that no longer answers at all, a cut the network does not
  report): it cancels as above, drops the connection and raises
  `DatabaseUnavailable`.
- ``COMMIT`` is bounded by the client alone, ``commit`` seconds, and never
  cancelled on the server. ``statement_timeout`` does not cover the wait
  for the synchronous standby (the server ends the statement's timer
  before it commits), and a cancel that reaches a backend waiting there
  makes it *commit locally* and answer success with a warning ("canceling
  wait for synchronous replication"), a success a failover then loses. So
  a commit that does not return in time is dropped with its connection,
  and a commit answered with that warning (an operator's
  ``pg_cancel_backend``, say) is not taken for a success either: both
  raise `CommitOutcomeUnknown` (a `DatabaseUnavailable`): it may or may not
  have happened, and the caller's rules for a lost connection apply (the
  work locks' do: `bmdb.work`).

Errors: a lost or unreachable server, and any `psycopg.Error` at connect (a
malformed URL too), become `DatabaseUnavailable` with a one-line message
from which the password is removed; errors reported by the server stay
psycopg's (`psycopg.Error` subclasses) for the transaction layer and the
migrations to classify with `bmdb.pgerrors` (`as_bmdb_error`: one table,
by SQLSTATE).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from typing import Any, TypeVar

import psycopg
import psycopg.errors
import trio
from psycopg import adapt, capabilities, generators, pq
from psycopg._queries import PostgresQuery
from psycopg.pq.abc import PGresult
from psycopg.waiting import Ready, Wait

from bmdb.errors import (
    CommitOutcomeUnknown,
    DatabaseUnavailable,
)
from bmdb.pgbounds import STATEMENT_GRACE, UNBOUNDED, Bounds, with_statement_timeout
from bmdb.pgerrors import first_line as _first_line
from bmdb.pgerrors import one_line as _one_line
from bmdb.pgerrors import without_password as _without_password
from common.text import printable

logger = logging.getLogger("bmdb.pg")

Row = tuple[Any, ...]
#: Statement parameters: positional (``%s``) or named (``%(name)s``).
Params = Sequence[Any] | Mapping[str, Any]

T = TypeVar("T")

TUPLES_OK = pq.ExecStatus.TUPLES_OK
COMMAND_OK = pq.ExecStatus.COMMAND_OK
FATAL_ERROR = pq.ExecStatus.FATAL_ERROR

#: At most this many statements are prepared per connection; others run
#: unnamed (the BMDB's own texts are far fewer).
MAX_PREPARED = 256

#: Seconds allowed to establish a connection before it counts as unavailable.
CONNECT_TIMEOUT = 5

#: Seconds allowed to finish sending a statement cancelled mid-send, and to
#: roll back, before the connection is given up (module docstring, step 1).
ABORT_TIMEOUT = 5.0

#: Seconds, once a cancelled statement is sent, that cancel requests are
#: repeated waiting for its result before the connection is given up
#: (step 2). Loaded or not, a server answers within milliseconds of the first
#: request that finds the statement started; this bounds a server that never
#: does (one not reading its cancel port, a statement that ignores cancels).
CANCEL_TIMEOUT = 3.0

#: Seconds between repeated cancel requests for one statement: the first, then
#: doubling up to the second (step 2).
CANCEL_RETRY = (0.05, 0.5)

#: Seconds allowed to end the backend of a connection given up on (step 3).
TERMINATE_TIMEOUT = 5.0

#: What `PgConnection._drive` runs when cancelled mid-statement.
_OnCancel = Callable[[Generator[Wait, Ready, Any], int, Wait], Awaitable[None]]

#: What a backend says when a wait for its synchronous standby was cut
#: short: the transaction committed locally only (PostgreSQL's syncrep.c).
_SYNCREP_CUT = "synchronous replication"


class PgConnection:
    """One PostgreSQL connection in autocommit mode, driven from Trio.

    Transactions are explicit (``BEGIN`` ... ``COMMIT``), issued by the
    caller. Not safe for concurrent use: one Trio task at a time (the pool
    ensures it).
    """

    def __init__(
        self, conn: psycopg.Connection[Row], conninfo: str, bounds: Bounds = UNBOUNDED
    ) -> None:
        self._conn = conn
        self.bounds = bounds
        #: The client's own deadline for one statement (see `Bounds`).
        self._deadline = None if bounds.statement is None else bounds.statement + STATEMENT_GRACE
        #: Warnings that a wait for the synchronous standby was cut short,
        #: received since the last `commit` began.
        self._syncrep_cut: list[str] = []
        conn.add_notice_handler(self._on_notice)
        #: To reach the server again, to end this connection's backend if a
        #: cancelled statement will not stop (see `_abort`).
        self._conninfo = conninfo
        self._pgconn = conn.pgconn
        self._encoding = conn.info.encoding
        # One adapter context for every statement: it caches the dumpers and
        # loaders it found per type, as a psycopg cursor does per query.
        self._tx = adapt.Transformer(conn)
        #: (query, parameter types) -> name of the server-side statement.
        self._prepared: dict[tuple[bytes, tuple[int, ...]], bytes] = {}
        #: A BEGIN to send together with the next statement (see `begin`).
        self._begin: bytes | None = None
        #: True if the last statement that carried a deferred BEGIN failed
        #: because the connection was lost: nothing ran in that transaction.
        self.lost_at_begin = False

    @classmethod
    async def connect(cls, conninfo: str, bounds: Bounds = UNBOUNDED) -> PgConnection:
        """Open a connection. ``conninfo`` is a libpq URL or key/value string;
        an empty string means the ``PG*`` environment variables. ``bounds``
        bound its statements and commits (none by default). The
        connection's ``client_encoding`` is UTF8, whatever they say.

        Raises `DatabaseUnavailable` when the server cannot be reached, and
        for any other `psycopg.Error` (a malformed ``conninfo`` too), with a
        one-line message that never contains the password; the psycopg error
        is not chained to it, as its text may (libpq quotes a malformed URL
        whole).
        """
        # The client always speaks UTF-8, whatever the server's or the
        # environment's default (PGCLIENTENCODING, a SQL_ASCII database):
        # text comes back as str, never as undecoded bytes.
        connect = functools.partial(
            psycopg.Connection.connect,
            conninfo,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT,
            client_encoding="UTF8",
            **with_statement_timeout(conninfo, bounds.statement),
        )
        try:
            conn = await trio.to_thread.run_sync(connect, abandon_on_cancel=True)
        except psycopg.Error as e:
            reason = _without_password(_one_line(e), conninfo)
        else:
            return cls(conn, conninfo, bounds)
        raise DatabaseUnavailable(f"cannot connect to the BMDB: {reason}")

    def begin(self, isolation: str) -> None:
        """Begin a transaction with the next statement.

        ``BEGIN ISOLATION LEVEL <isolation>`` is not sent on its own: it
        goes in the same round trip as the next statement (libpq pipeline
        mode: BEGIN, the statement, one Sync). The server runs them in that
        order, exactly as if BEGIN had been executed first; if BEGIN fails,
        the statement is skipped. It saves one round trip per transaction,
        which carried no information (about 1/8 of a claim+finish cycle).
        """
        self._begin = f"BEGIN ISOLATION LEVEL {isolation}".encode()

    async def commit(self) -> None:
        """Commit the open transaction, within the commit bound.

        Never cancelled on the server when bounded (module docstring,
        "Bounds"). Raises
        `CommitOutcomeUnknown` when the commit does not return in time (the
        connection is closed first) or returns with the warning that the
        wait for the synchronous standby was cut short; `DatabaseUnavailable`
        when the connection is lost; a `psycopg.Error` for a refusal (a
        serialization failure at commit). Cancellation of the caller is as
        for `execute`: the outcome is then unknown too.
        """
        if self._conn.closed:
            raise DatabaseUnavailable("the BMDB connection is closed")
        if self._begin is not None:
            self._begin = None  # nothing was sent: nothing to commit
            return
        self._syncrep_cut.clear()
        bound = self.bounds.commit
        with trio.CancelScope() as scope:
            if bound is not None:
                scope.relative_deadline = bound
            try:
                results = await self._drive(
                    self._simple(b"COMMIT"), on_cancel=None if bound is None else self._drop
                )
            except psycopg.OperationalError as e:
                if self._conn.closed or self._conn.broken:
                    raise CommitOutcomeUnknown(
                        "lost the BMDB connection during COMMIT, its outcome unknown:"
                        f" {_first_line(e)}"
                    ) from e
                raise
        if scope.cancelled_caught:
            raise CommitOutcomeUnknown(
                f"COMMIT did not return within {bound:g} s (a primary waiting for a"
                " synchronous standby it lost?): connection dropped, outcome unknown"
            )
        _check(results, self._encoding)
        if self._syncrep_cut:
            await self.close()
            raise CommitOutcomeUnknown(
                f"COMMIT returned, but {self._syncrep_cut[0]}: it may be lost at a failover;"
                " connection dropped, outcome unknown"
            )

    def on_notify(self, callback: Callable[[str, str], None]) -> None:
        """Call ``callback(channel, payload)`` for every notification this
        connection receives (after ``LISTEN``), whenever it reads from the
        server: in `wait_for_input`, and amid a statement's results. The
        callback runs inside the read and must not block; nothing queues
        notifications meanwhile (psycopg's backlog stays empty)."""

        def handler(notify: psycopg.Notify) -> None:
            callback(notify.channel, notify.payload)

        self._conn.add_notify_handler(handler)

    async def wait_for_input(self) -> None:
        """Wait, with no statement running, until the server sends something,
        and take it in: notifications go to the `on_notify` callbacks.

        Raises `DatabaseUnavailable` if the connection is lost (the server
        closed it, or restarted). Cancelled, it leaves the connection as it
        was: nothing was sent, so there is nothing to cancel on the server.
        """
        if self._conn.closed:
            raise DatabaseUnavailable("the BMDB connection is closed")
        try:
            await self._drive(generators.notifies(self._pgconn), on_cancel=_nothing_to_abort)
        except psycopg.OperationalError as e:
            await self.close()
            raise DatabaseUnavailable(f"lost the BMDB connection: {_first_line(e)}") from e

    async def _drop(self, gen: Generator[Wait, Ready, Any], fileno: int, state: Wait) -> None:
        """What a cancelled `commit` does instead of `_abort`: close the
        connection and send nothing (a cancel would commit locally)."""
        await self.close()

    def _on_notice(self, diag: psycopg.errors.Diagnostic) -> None:
        message = diag.message_primary or ""
        if _SYNCREP_CUT in message:
            detail = diag.message_detail
            self._syncrep_cut.append(printable(f"{message} ({detail})" if detail else message))

    async def execute(self, query: str, params: Params | None = None) -> list[Row]:
        """Run one statement (or, without params, several) and return the
        rows of the first result (empty if it returns none).

        A statement given ``params`` (even empty ones) is prepared on its
        first use on this connection (in the same round trip) and executed
        by name from then on, so the server parses it once (and, if it
        chooses a generic plan, plans it once): the BMDB's statements are a
        fixed set of texts run over and over. Statements without params use
        the simple protocol, which allows several in one call (migrations,
        ``COMMIT``).

        Raises `DatabaseUnavailable` if the connection is lost or the server
        does not answer within the statement bound and its grace (the
        connection is then closed), a
        `psycopg.Error` for errors reported by the server, and a plain
        `trio.Cancelled` when cancelled, also mid-send: only once the
        statement does not run on the server any more, within a few seconds
        (`ABORT_TIMEOUT`, `CANCEL_TIMEOUT`, `TERMINATE_TIMEOUT`, see the
        module docstring); the connection is then idle (or in a failed
        transaction), or closed.
        """
        if self._conn.closed:
            raise DatabaseUnavailable("the BMDB connection is closed")
        if self._deadline is None:
            return await self._execute(query, params)
        with trio.move_on_after(self._deadline):
            return await self._execute(query, params)
        # The cancel has run (`_abort`): whatever the server does now, this
        # connection is not to be trusted with the next statement.
        await self.close()
        raise DatabaseUnavailable(
            f"the BMDB did not answer a statement within {self._deadline:g} s"
            " (its statement_timeout and a grace): connection dropped"
        )

    async def _execute(self, query: str, params: Params | None) -> list[Row]:
        begin, self._begin = self._begin, None
        self.lost_at_begin = False
        try:
            if params is None:
                if begin is not None:
                    _check(await self._drive(self._simple(begin)), self._encoding)
                results = await self._drive(self._simple(query.encode(self._encoding)))
            else:
                results = await self._drive(self._extended(query, params, begin))
            _check(results, self._encoding)
        except psycopg.OperationalError as e:
            if self._conn.closed or self._conn.broken:
                self.lost_at_begin = begin is not None
                raise DatabaseUnavailable(f"lost the BMDB connection: {_first_line(e)}") from e
            raise
        if not results or results[0].status != TUPLES_OK:
            return []
        result = results[0]
        self._tx.set_pgresult(result)
        return self._tx.load_rows(0, result.ntuples, tuple)

    def _simple(self, query: bytes) -> Generator[Wait, Ready, list[PGresult]]:
        """Send ``query`` with the simple protocol; its results."""
        self._pgconn.send_query(query)
        results: list[PGresult] = yield from generators.execute(self._pgconn)
        return results

    def _extended(
        self, query: str, params: Params, begin: bytes | None
    ) -> Generator[Wait, Ready, list[PGresult]]:
        """Run one statement with the extended protocol, preparing it on first
        use and preceded by ``begin`` if given; its results (the first error
        instead, if any command failed)."""
        pgconn = self._pgconn
        pgq = PostgresQuery(self._tx)
        pgq.convert(query, params)
        key = (pgq.query, pgq.types)
        name = self._prepared.get(key)
        if name is not None and begin is None:
            # The common case: one Bind/Execute of a prepared statement.
            pgconn.send_query_prepared(name, pgq.params, param_formats=pgq.formats)
            results: list[PGresult] = yield from generators.execute(pgconn)
            return results
        # Several messages in one round trip: pipeline mode, one Sync. The
        # server runs them in order; after an error it skips the rest.
        prepare = name is None and len(self._prepared) < MAX_PREPARED
        if prepare:
            name = b"bmdb_%d" % len(self._prepared)
        pgconn.enter_pipeline_mode()
        if begin is not None:
            pgconn.send_query_params(begin, None)
        if name is not None and prepare:
            pgconn.send_prepare(name, pgq.query, param_types=pgq.types)
        if name is not None:
            pgconn.send_query_prepared(name, pgq.params, param_formats=pgq.formats)
        else:
            pgconn.send_query_params(
                pgq.query, pgq.params, param_formats=pgq.formats, param_types=pgq.types
            )
        pgconn.pipeline_sync()
        yield from generators.send(pgconn)
        commands = 1 + (begin is not None) + prepare
        replies: list[list[PGresult]] = []
        for _ in range(commands + 1):  # each command's results, then the Sync's
            replies.append((yield from generators.fetch_many(pgconn)))
        try:
            pgconn.exit_pipeline_mode()
        except psycopg.OperationalError:
            # Replies are missing ("cannot exit pipeline mode while busy"):
            # seen when a fast shutdown ends the backend mid-pipeline before
            # libpq noticed the connection close. What the connection would
            # answer next is unknown: it is lost (execute then raises
            # DatabaseUnavailable).
            self._conn.close()
            raise
        parsed = replies[commands - 2] if prepare else []
        if name is not None and parsed and parsed[0].status == COMMAND_OK:
            # Server-side statements outlive transactions, rolled back or not.
            self._prepared[key] = name
        errors = [r for reply in replies[:commands] for r in reply if r.status == FATAL_ERROR]
        return errors or replies[commands - 1]

    async def _drive(
        self,
        gen: Generator[Wait, Ready, T],
        *,
        on_cancel: _OnCancel | None = None,
    ) -> T:
        """Run one of psycopg's protocol generators to completion.

        If cancelled, the statement is cancelled on the server first (see
        `_abort`; ``on_cancel`` instead if given); then the plain
        `trio.Cancelled` propagates.
        """
        fileno = self._pgconn.socket
        abort = self._abort if on_cancel is None else on_cancel
        try:
            state = next(gen)
            while True:
                try:
                    ready = await _wait(fileno, state)
                except trio.Cancelled:
                    await abort(gen, fileno, state)
                    raise
                state = gen.send(ready)
        except StopIteration as stop:
            value: T = stop.value
            return value

    async def _abort(self, gen: Generator[Wait, Ready, Any], fileno: int, state: Wait) -> None:
        """Finish sending, cancel the statement on the server until its
        result arrives, and drain the generator, so that the connection is
        not left mid-statement; if that takes too long, close the connection
        and end its backend (steps 1-3 of the module docstring). Shielded
        and bounded; never raises."""
        with trio.CancelScope(shield=True):
            pid = self._pgconn.backend_pid
            ended = False
            try:
                # psycopg's generators wait for R/W only while flushing, and
                # for R alone once everything is sent.
                with trio.move_on_after(ABORT_TIMEOUT):
                    while state != Wait.R:
                        state = gen.send(await _wait(fileno, state))
                if state == Wait.R:
                    with trio.move_on_after(CANCEL_TIMEOUT):
                        ended = await self._cancel_until_ended(gen, fileno, state)
            except StopIteration:
                ended = True
            except (psycopg.Error, OSError) as e:
                # QueryCanceled is the expected answer; it comes as a result,
                # so anything raised here means the connection is lost.
                logger.debug("aborted statement ended with: %s", _first_line(e))
                self._conn.close()
                return
            if ended and self._pgconn.transaction_status not in (
                pq.TransactionStatus.ACTIVE,
                pq.TransactionStatus.UNKNOWN,
            ):
                return
            logger.warning(
                "a cancelled statement did not end in time: closing its connection"
                " and terminating its backend (pid %d)",
                pid,
            )
            self._conn.close()
            await _terminate_backend(self._conninfo, pid)

    async def _cancel_until_ended(
        self, gen: Generator[Wait, Ready, Any], fileno: int, state: Wait
    ) -> bool:
        """Send cancel requests at growing intervals (`CANCEL_RETRY`) while
        reading the statement's result; True once it has all arrived.

        Not bounded by itself (`_abort` bounds it). A request that fails to
        be sent is logged and tried again at the next interval. Raises what
        ``gen`` raises when the connection is lost.
        """
        interval, longest = CANCEL_RETRY
        try:
            while True:
                if self._pgconn.transaction_status == pq.TransactionStatus.ACTIVE:
                    try:
                        await self._request_cancel()
                    except psycopg.OperationalError as e:
                        logger.debug("cancel request failed: %s", _first_line(e))
                with trio.move_on_after(interval):
                    while True:
                        state = gen.send(await _wait(fileno, state))
                interval = min(2 * interval, longest)
        except StopIteration:
            # Caught here: a StopIteration may not leave a coroutine.
            return True

    async def _request_cancel(self) -> None:
        """Send the server one cancel request for this connection and wait
        until the server took it (not until the statement ended).

        Raises `psycopg.OperationalError` if the request cannot be sent.
        Cancellation abandons the request.
        """
        if not capabilities.has_cancel_safe():
            # libpq < 17: only the blocking PQcancel exists.
            await trio.to_thread.run_sync(self._conn.cancel, abandon_on_cancel=True)
            return
        cancel_conn = self._pgconn.cancel_conn()
        try:
            cancel_conn.start()
            steps = generators.cancel(cancel_conn)
            try:
                fileno, wait = next(steps)
                while True:
                    fileno, wait = steps.send(await _wait(fileno, wait))
            except StopIteration:
                pass
        finally:
            cancel_conn.finish()

    @property
    def user(self) -> str:
        """The role this connection logged in as (for error messages)."""
        return self._conn.info.user

    @property
    def in_transaction(self) -> bool:
        """True while a transaction is open (healthy or failed)."""
        status = self._conn.info.transaction_status
        return status in (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)

    @property
    def reusable(self) -> bool:
        """True if the connection is open and idle outside a transaction."""
        return (
            not self._conn.closed
            and self._conn.info.transaction_status == pq.TransactionStatus.IDLE
            and self._pgconn.pipeline_status == pq.PipelineStatus.OFF
        )

    async def rollback_quietly(self) -> None:
        """Roll back any open transaction, swallowing errors.

        Runs shielded with a short bound: it is called while unwinding from
        errors and cancellation. If it fails the connection is not `reusable`.
        """
        self._begin = None  # never sent: nothing to roll back
        with trio.CancelScope(shield=True) as scope:
            scope.relative_deadline = ABORT_TIMEOUT
            try:
                if not self._conn.closed and self.in_transaction:
                    await self.execute("ROLLBACK")
            except (psycopg.Error, DatabaseUnavailable, OSError) as e:
                logger.debug("rollback failed, dropping connection: %s", e)
                await self.close()
        if scope.cancelled_caught:
            await self.close()

    async def close(self) -> None:
        """Close the connection (never raises; a no-op if closed)."""
        try:
            self._conn.close()
        except (psycopg.Error, OSError) as e:
            logger.debug("closing connection failed: %s", e)


async def _terminate_backend(conninfo: str, pid: int) -> None:
    """End backend ``pid`` if it still runs a statement, from a new
    connection, and wait until it is gone.

    For a connection we closed while its statement ran: the backend would
    notice only when it next reads or writes the socket. One that is not
    running a statement (still reading a half-sent one, say) ends by itself
    on reading the end of the stream; we wait for that too. Bounded by
    `TERMINATE_TIMEOUT`; never raises: a failure (the server refuses, or is
    unreachable) is logged as a warning, and the backend then lives until
    its statement ends.
    """
    with trio.move_on_after(TERMINATE_TIMEOUT) as scope:
        try:
            observer = await PgConnection.connect(conninfo)
        except DatabaseUnavailable as e:
            logger.warning("cannot terminate backend %d: %s", pid, e)
            return
        try:
            while True:
                # A row while the backend exists; terminated only while it
                # runs a statement (pg_stat_activity's snapshot is per
                # transaction, and each of these is one).
                alive = await observer.execute(
                    """SELECT CASE WHEN state = 'active' THEN pg_terminate_backend(pid) END
                       FROM pg_stat_activity WHERE pid = %s""",
                    (pid,),
                )
                if not alive:
                    break
                await trio.sleep(0.02)
        except (psycopg.Error, DatabaseUnavailable) as e:
            logger.warning("cannot terminate backend %d: %s", pid, _first_line(e))
        finally:
            await observer.close()
    if scope.cancelled_caught:
        logger.warning("backend %d did not end within %s s", pid, TERMINATE_TIMEOUT)


async def _nothing_to_abort(gen: Generator[Wait, Ready, Any], fileno: int, state: Wait) -> None:
    """What a cancelled `PgConnection.wait_for_input` does: nothing (no statement runs)."""


def _check(results: list[PGresult], encoding: str) -> None:
    """Raise the error the server reported in ``results``, if any."""
    for result in results:
        if result.status == FATAL_ERROR:
            raise psycopg.errors.error_from_result(result, encoding=encoding)


async def _wait(fileno: int, state: Wait) -> Ready:
    """Wait until the socket is ready as ``state`` asks; say how it is."""
    if state == Wait.R:
        await trio.lowlevel.wait_readable(fileno)
        return Ready.R
    if state == Wait.W:
        await trio.lowlevel.wait_writable(fileno)
        return Ready.W
    # Wait.RW: libpq is flushing a large message and may need to read to
    # make progress. Rare, so the cost of a nursery is fine here.
    ready = 0

    async def until(wait: Any, flag: Ready, scope: trio.CancelScope) -> None:
        nonlocal ready
        await wait(fileno)
        ready |= flag
        scope.cancel()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(until, trio.lowlevel.wait_readable, Ready.R, nursery.cancel_scope)
            nursery.start_soon(until, trio.lowlevel.wait_writable, Ready.W, nursery.cancel_scope)
    except BaseExceptionGroup as group:
        # A cancellation from outside reaches both waits, and the nursery
        # groups their two Cancelled. Callers (and `_drive`, which must see
        # the Cancelled to abort the statement) expect what a single wait
        # raises: one exception, an error in preference to Cancelled.
        raise _single(group) from None
    return Ready(ready)


def _single(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first error among the leaves of ``group``, else its first leaf."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            pending[:0] = exc.exceptions
        else:
            leaves.append(exc)
    errors = [e for e in leaves if not isinstance(e, trio.Cancelled)]
    return (errors or leaves)[0]
