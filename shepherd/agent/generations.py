"""What the installer and the upgrader share: a kind of request run once per
generation, recorded in a state file beside the agent.

`Generations` is told each accepted heartbeat's request of its kind; a
request of a generation greater than the last one begun is recorded
("generation g started", in ``<agent>.<kind>.json``, written atomically)
before it has any side effect, so that it never runs twice, across restarts
and kills too; one of an older generation (or of none above 0) is refused
and said once (`Told`). A state file that cannot be read or written makes
every later request refused, with the cause as the report: unrecorded, a
generation could run twice. `installer.Installer` and `upgrade.Upgrader`
run the generations and say what the heartbeats report.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .daemon import log
from .files import write_atomically
from .install import Settings

if TYPE_CHECKING:
    import ssl

#: Bound on an error cause the agent reports.
MAX_ERROR = 4000
#: Messages about refused requests the installer (and the upgrader) remembers
#: having logged (`Told`), so as not to log them at every heartbeat.
TOLD_MAX = 64


class Told:
    """Messages logged once per generation (heartbeats repeat requests).

    Remembers the last `TOLD_MAX` messages only: a server that asks for one
    refused generation after another (each a new entry) cannot grow the
    agent's memory; a message forgotten is logged again if asked again,
    which a server repeating that many refusals has earned.
    """

    def __init__(self) -> None:
        # A dict as an ordered set, oldest first.
        self._seen: dict[tuple[int, str], None] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def tell(self, generation: int, message: str) -> None:
        key = (generation, message)
        if key in self._seen:
            return
        self._seen[key] = None
        if len(self._seen) > TOLD_MAX:
            del self._seen[next(iter(self._seen))]
        log(message)


def read_state(path: str, statuses: tuple[str, ...]) -> dict[str, Any] | None:
    """The JSON state file at ``path`` (an install's or an upgrade's), or None
    if there is none; ValueError or OSError if it cannot be read, has no
    generation, or a status not among ``statuses``."""
    try:
        with open(path, "rb") as f:
            state = json.loads(f.read(64 * 1024))
    except FileNotFoundError:
        return None
    if not isinstance(state, dict) or not isinstance(state.get("generation"), int):
        raise ValueError("no generation in it")
    if state.get("status") not in statuses:
        raise ValueError(f"unknown status {state.get('status')!r}")
    return state


class Generations:
    """The state of one kind of request (see the module); the lock guards it.

    A subclass names its ``KIND`` (the state file's and the messages'),
    ``DOING`` (what a broken state stops), ``REQUEST`` (what a refused
    request is called) and the ``STATUSES`` its state file may hold, and
    sets its own attributes before this constructor runs: it reads the
    state file and calls `_loaded` with what it finds.
    """

    KIND = ""
    DOING = ""
    REQUEST = ""
    STATUSES: tuple[str, ...] = ()

    def __init__(
        self,
        agent_path: str,
        *,
        endpoint_scheme: str,
        ca_certificate: bytes,
        settings: Settings | None = None,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.agent = os.path.abspath(agent_path)
        self.agent_dir = os.path.dirname(self.agent)
        self.state_file = f"{self.agent}.{self.KIND}.json"
        self.endpoint_scheme = endpoint_scheme
        self.ca_certificate = ca_certificate
        self.settings = settings or Settings()
        self.wake = wake
        self._lock = threading.Lock()
        self._state: dict[str, Any] | None = None
        #: Why the state file cannot be trusted; every request is then refused.
        self._broken: str | None = None
        #: The generation the server's last answer carried.
        self._carried: int | None = None
        self._worker: threading.Thread | None = None
        self._told = Told()
        try:
            state = read_state(self.state_file, self.STATUSES)
        except (OSError, ValueError) as exc:
            self._broken = (
                f"{self.KIND} state {self.state_file} is unreadable ({exc}); not {self.DOING}"
            )
            log(self._broken)
            return
        if state is not None:
            self._state = state
            self._loaded(state)

    def _loaded(self, state: dict[str, Any]) -> None:
        """Finish what an earlier run of the agent left in ``state`` (the state
        file's, when the agent starts), if anything: the subclass's."""

    def _save(self, state: dict[str, Any]) -> None:
        write_atomically(self.state_file, json.dumps(state).encode() + b"\n")
        self._state = state

    def _tell(self, generation: int, message: str) -> None:
        self._told.tell(generation, message)

    @property
    def generation(self) -> int:
        """The last generation of this kind the agent has begun (0: none)."""
        return int(self._state["generation"]) if self._state is not None else 0

    def _take(self, generation: int | None) -> int | None:
        """Note the generation an answer carried (None: none); the caller
        holds the lock. The generation to act on: the last one begun or a
        newer one; None for none, with a broken state, or for a generation
        below 1 or older than the last begun (said once)."""
        self._carried = generation
        if generation is None or self._broken is not None:
            return None
        g = generation
        if g <= 0:
            self._tell(g, f"ignoring {self.REQUEST} of generation {g}: generations start at 1")
            return None
        if g < self.generation:
            self._tell(g, f"ignoring {self.REQUEST} of generation {g}: {self.generation} is newer")
            return None
        return g

    def _begin(self, generation: int) -> bool:
        """Record ``generation`` started, before any side effect (the caller
        holds the lock); False if that fails: unrecorded, a generation could
        run twice, so none runs from now on."""
        try:
            self._save({"generation": generation, "status": "started"})
        except OSError as exc:
            self._broken = f"cannot record {self.KIND} state in {self.state_file}: {exc}"
            log(f"{self._broken}; not {self.DOING}")
            return False
        return True

    def join(self, timeout: float | None = None) -> None:
        """Wait for the running worker, if any (tests)."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout)

    def _context(self) -> ssl.SSLContext:
        import ssl

        return ssl.create_default_context(cadata=self.ca_certificate or None)
