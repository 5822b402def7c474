"""The BMDB: the fleet's source of truth, on PostgreSQL.

Machines carry *tags* (facts, one table each: provided by a provider, agent
started, heartbeat, ...). Components act on machines under *sessions*, and
take *work* locks on (machine, process) so that many workers never act on
one machine at once. A failed work hides the machine from its process for
a *backoff*; every start and outcome lands in the machine's *history*.

Public API::

    import bmdb
    from bmdb import Backoff, Process, Provider, ProviderStatus
    from bmdb.errors import BMDBError, SessionExpired, NothingToDo, WorkConflict, ...
    from bmdb.model import Queries, MachineProvided, AgentStarted, HistoryEvent, ...

    async with bmdb.open_connection(url, migrate=True) as conn:   # url=None: PG* env vars
        async with conn.session("shepherd-initializer", "host:pid") as sess:
            result = await sess.transact(fn)     # fn: async (q: Queries) -> T, SERIALIZABLE
            work = await sess.work(Process.SHEPHERD_AGENT_START, source)
            #   source: async (q: Queries) -> list[UUID]; raise NothingToDo if none
            async with work:                     # canceled unless finished or failed
                ...work.machine_id...
                await work.finish(apply)         # apply: async (q: Queries) -> None
                # or: await work.fail("cause", Backoff(initial=60, maximum=600, exponent=2))

Everything runs on Trio: psycopg's protocol is driven by Trio's own I/O
waits (see `bmdb._pg` for why not the asyncio driver behind trio-asyncio),
so no asyncio loop is needed. Cancellation is Trio's: a cancelled call
cancels its query on the server and rolls back. If the session expires,
the ``async with conn.session()`` block is cancelled and raises
`SessionExpired`.

Where this departs from Monogon's Go BMDB, and why (details in the modules
named; the layers and rules are in ARCHITECTURE.md at the repository root):

- Work transactions (claim, finish, fail) run REPEATABLE READ, not
  SERIALIZABLE: SSI's page-level predicate locks made concurrent finishes
  abort each other often under many workers; row locks plus a claim
  generation on the machine row give the exclusion instead (`bmdb.work`).
  `Session.transact` stays SERIALIZABLE.
- Locking agent-start sources pick at random among the oldest
  `bmdb.model.SOURCING_WINDOW` candidates ("oldest first", approximately),
  so parallel workers do not race for one row (`bmdb.model.sourcing`).
- psycopg is driven natively by Trio rather than through trio-asyncio: a
  statement costs about a quarter of the CPU (`bmdb._pg`).
- Expired sessions stop blocking their machines as soon as their deadline
  passes (sourcing ignores them, claims take their rows over); collection
  only tidies up and records "Canceled" (`bmdb.session`).

Modules, top down (each imports only those below it)::

    __main__ (CLI) -> connection -> session -> work -> transaction -> model, _pool -> _pg

`connection` (open_connection, Connection: a thin facade), `session`
(Session, heartbeat, expired-session collection), `work` (claiming, Work,
the Lease it shares with its Session), `transaction` (Transactor: pool,
isolation, retries, stats), `backoff` (work backoff intervals), `model`
(enums, rows, Queries), `migrations` (SQL files and runner), `_pg` (the
driver), `errors`, `localserver` (a throwaway PostgreSQL for the demo,
tests and benchmarks), `localha` (the same as a three-member Patroni
cluster with synchronous replication; ``python -m bmdb.localha``),
`actions` (operator actions, each with its audit record). ``python -m
bmdb`` is the command-line tool (migrate, machines, history, sessions,
audit, and the actions: hold, release, retry-now, ...).
"""

from common.lazy import exports

TYPE_CHECKING = False

# Imported on first use (common.lazy): ``python -m bmdb --help`` and the
# modules that need only the enums or the errors do not pay for psycopg.
if TYPE_CHECKING:
    from bmdb.backoff import Backoff as Backoff
    from bmdb.connection import Connection as Connection
    from bmdb.connection import open_connection as open_connection
    from bmdb.model.enums import Process as Process
    from bmdb.model.enums import Provider as Provider
    from bmdb.model.enums import ProviderStatus as ProviderStatus
    from bmdb.model.enums import WorkEvent as WorkEvent
    from bmdb.model.queries import Queries as Queries
    from bmdb.pgbounds import Bounds as Bounds
    from bmdb.session import Session as Session
    from bmdb.transaction import Isolation as Isolation
    from bmdb.transaction import RetryPolicy as RetryPolicy
    from bmdb.transaction import Stats as Stats
    from bmdb.work import Work as Work
else:
    __getattr__ = exports(
        __name__,
        {
            "bmdb.pgbounds": ["Bounds"],
            "bmdb.backoff": ["Backoff"],
            "bmdb.connection": ["Connection", "open_connection"],
            "bmdb.model.enums": ["Process", "Provider", "ProviderStatus", "WorkEvent"],
            "bmdb.model.queries": ["Queries"],
            "bmdb.session": ["Session"],
            "bmdb.transaction": ["Isolation", "RetryPolicy", "Stats"],
            "bmdb.work": ["Work"],
        },
    )

__all__ = [
    "Backoff",
    "Bounds",
    "Connection",
    "Isolation",
    "Process",
    "Provider",
    "ProviderStatus",
    "Queries",
    "RetryPolicy",
    "Session",
    "Stats",
    "Work",
    "WorkEvent",
    "open_connection",
]
