"""The machine list's counts per state, taken at most once per period and shared.

The machine list shows how many machines are in each state
(`bmdb.overview.state_counts`). Those states are derived from time
(heartbeat age, backoff ends, the 30 minutes after an agent start), so no
trigger can keep a count table true: a machine turns silent without any
write. Counting them means reading the whole fleet, 0.4 to 0.7 s at
100,000 machines, while the page's own rows are a keyset read of a hundred
machines. So the counts are not taken per request:

- a `CountsCache` takes them at most once per ``period`` (5 s unless told)
  per provider filter, and every page within the period shows the same
  counts;
- one query at a time per filter (single flight): requests that need
  counts while one is being taken wait for that one, none starts another;
- counts older than the period but younger than ``max_age`` (60 s) are
  shown as they are while one refresh runs for the next page (so an
  operator paging now and then does not wait for a fleet scan); older
  ones, or none, are waited for;
- the page says when its counts were taken ("counts as of ..."), by the
  database's clock; its rows are read fresh by every request.

The queries run in a nursery the cache is given, not in the task of the
request that asked first: a request that is cancelled (its client went
away) stops waiting, and the query goes on for the others. The nursery's
lifetime is the owner's (`console.server.serve` opens one around the HTTP
server); cancelling it cancels a query in flight, whose waiters then get
`CountsUnavailable`. A query that fails is logged, its waiters get its
error (`bmdb.errors.BMDBError`, e.g. `DatabaseUnavailable`), and nothing
of it is kept: the next request that needs counts starts a new query; the
counts taken before stay usable as long as they are younger than
``max_age``.

What this costs: at most one fleet scan per period per filter per process
while pages are being viewed, none while they are not.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import trio

from bmdb import overview
from bmdb.connection import Connection
from bmdb.errors import BMDBError
from bmdb.model import Provider
from bmdb.overview import StateCounts
from console.errors import CountsUnavailable

logger = logging.getLogger("console.counts")

#: Seconds counts are shown without asking the database again.
DEFAULT_PERIOD = 5.0
#: Seconds after which counts are no longer shown while a new query runs.
DEFAULT_MAX_AGE = 60.0


@dataclass(eq=False)
class Pending:
    """Counts being taken (or taken already): `wait` for them."""

    done: trio.Event = field(default_factory=trio.Event)
    counts: StateCounts | None = None
    error: BaseException | None = None

    @classmethod
    def ready(cls, counts: StateCounts) -> Pending:
        pending = cls(counts=counts)
        pending.done.set()
        return pending

    async def wait(self) -> StateCounts:
        """The counts once taken. Raises the query's error (a `BMDBError`,
        or `CountsUnavailable` if the cache closed first). Cancelling the
        wait cancels only the wait."""
        await self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.counts is not None
        return self.counts


@dataclass(frozen=True)
class _Taken:
    #: `trio.current_time` when the query started (its snapshot is at most this old).
    started: float
    counts: StateCounts


class CountsCache:
    """Counts per state of ``conn``'s fleet, per provider filter, taken in
    ``nursery`` (see the module docstring). Use from one Trio run."""

    def __init__(
        self,
        conn: Connection,
        nursery: trio.Nursery,
        *,
        period: float = DEFAULT_PERIOD,
        max_age: float = DEFAULT_MAX_AGE,
    ) -> None:
        """``period``: seconds counts are shown without a new query (0:
        every request that needs counts starts or joins one). ``max_age``:
        seconds counts may be shown while a new query runs (at least
        ``period``). ValueError for a negative period or max_age."""
        if not period >= 0 or not max_age >= 0:
            raise ValueError(f"period and max_age must be >= 0, got {period!r}, {max_age!r}")
        self._conn = conn
        self._nursery = nursery
        self.period = period
        self.max_age = max(max_age, period)
        self._taken: dict[Provider | None, _Taken] = {}
        self._flights: dict[Provider | None, Pending] = {}
        #: Count queries started so far.
        self.queries = 0

    def fetch(self, provider: Provider | None = None) -> Pending:
        """The counts of ``provider``'s machines (None: all), without
        waiting: counts taken within the period; else the query in flight,
        or a new one started now; while it runs, counts younger than
        ``max_age`` if there are (the query then serves the next call)."""
        taken = self._taken.get(provider)
        age = math.inf if taken is None else trio.current_time() - taken.started
        if taken is not None and age < self.period:
            return Pending.ready(taken.counts)
        flight = self._flights.get(provider)
        if flight is None:
            flight = self._flights[provider] = Pending()
            self._nursery.start_soon(self._query, provider, flight)
        if taken is not None and age < self.max_age:
            return Pending.ready(taken.counts)
        return flight

    async def get(self, provider: Provider | None = None) -> StateCounts:
        """`fetch` and wait (see `Pending.wait`)."""
        return await self.fetch(provider).wait()

    def in_flight(self, provider: Provider | None = None) -> Pending | None:
        """The query of ``provider``'s counts running now, if one is."""
        return self._flights.get(provider)

    async def _query(self, provider: Provider | None, flight: Pending) -> None:
        started = trio.current_time()
        self.queries += 1
        try:
            counts = await overview.state_counts(self._conn, provider=provider)
        except Exception as e:
            # Not kept: the next request asks again. A BMDBError is the
            # database's to explain; anything else is a bug, with its traceback.
            flight.error = e
            logger.warning("count query failed: %s", e, exc_info=not isinstance(e, BMDBError))
        else:
            self._taken[provider] = _Taken(started, counts)
            flight.counts = counts
        finally:
            del self._flights[provider]
            if flight.counts is None and flight.error is None:
                flight.error = CountsUnavailable(
                    "the count query was cancelled: the UI is stopping"
                )
            flight.done.set()
