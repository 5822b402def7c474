"""The heartbeat client: signed (or session-MACed) heartbeats to the BMaaS endpoint.

How requests are authenticated is `protocol`; this module sends them, keeps
the connection and the session, and backs off while heartbeats fail.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import protocol
from .daemon import log
from .ed25519 import ed25519_public_key, ed25519_sign
from .errors import AgentError
from .wire import (
    AgentSession,
    DecodeError,
    HwNode,
    InstallationReport,
    TakeoverInit,
    decode_heartbeat_session,
    decode_installation_request,
    decode_upgrade_request,
    encode_heartbeat_request,
)

if TYPE_CHECKING:
    import http.client
    import ssl

    from .installer import Installer
    from .upgrade import Upgrader

# The heartbeat's modules (http.client, ssl, urllib.parse, base64, random)
# are imported where they are used, not here: constructing a Heartbeater is
# on the takeover's critical path, and they would about double the agent's
# start-up time.

#: Bound on one heartbeat exchange (connect, TLS, request, the whole
#: answer), seconds: each step gets what remains of it, and an answer
#: trickled in a byte at a time is given up when it runs out.
REQUEST_TIMEOUT = 15.0
#: Bound on an answer's size: room for an installation request with the
#: largest node parameters the installer takes (`installplan.MAX_NODE_PARAMETERS`),
#: so that one too large is refused with that cause rather than cut.
MAX_ANSWER = 2 * 1024 * 1024
#: How much later than asked a held answer may come (the server answers
#: those whose time is up every `shepherd.agent_server.hold.HOLD_TICK`).
HOLD_SLACK = 2.0


def request_headers(
    machine_id: str,
    body: bytes,
    time_ns: int,
    session: AgentSession | None,
    *,
    public_key: bytes,
    sign: Callable[[bytes], bytes],
    hold: float = 0.0,
) -> dict[str, str]:
    """The headers of a heartbeat request with ``body`` sent at ``time_ns``:
    MACed with ``session`` if given, else signed with ``sign`` (the agent's
    Ed25519 signature of a message, checked against ``public_key``); with
    ``hold`` seconds, asking the server to hold the answer that long while
    it has nothing to answer (`protocol.HEADER_HOLD`).

    The agent's `Heartbeater` sends these; the fleet simulator
    (``bench/fleet.py``) sends the same for each of its simulated agents.
    """
    import base64

    message = protocol.signed_message("POST", protocol.HEARTBEAT_PATH, machine_id, time_ns, body)
    headers = {
        "Content-Type": "application/proto",
        "Connect-Protocol-Version": "1",
        "Connect-Timeout-Ms": str(int((REQUEST_TIMEOUT + hold) * 1000)),
        protocol.HEADER_TIME: str(time_ns),
    }
    if hold > 0:
        headers[protocol.HEADER_HOLD] = str(int(hold * 1000))
    if session is not None:
        headers[protocol.HEADER_SESSION] = base64.b64encode(session.token).decode("ascii")
        mac = protocol.session_mac(session.key, message)
        headers[protocol.HEADER_MAC] = base64.b64encode(mac).decode("ascii")
    else:
        headers[protocol.HEADER_KEY] = base64.b64encode(public_key).decode("ascii")
        headers[protocol.HEADER_SIGNATURE] = base64.b64encode(sign(message)).decode("ascii")
    return headers


class Heartbeater:
    """Sends heartbeats to the endpoint of ``init``, signed with ``seed``."""

    def __init__(
        self,
        init: TakeoverInit,
        seed: bytes,
        *,
        interval: float,
        backoff_cap: float,
        report: tuple[HwNode, list[str]] | None = None,
    ) -> None:
        self.init = init
        self.seed = seed
        self.public_key = ed25519_public_key(seed)
        self.interval = interval
        self.backoff_cap = max(backoff_cap, interval)
        self.report = report  # sent until one heartbeat carrying it is accepted
        #: Told each answer's installation request; gives the report to send.
        self.installer: Installer | None = None
        #: The same for upgrade requests.
        self.upgrader: Upgrader | None = None
        import threading

        #: Set to send the next heartbeat now (an install's outcome is ready).
        self.wake = threading.Event()
        #: The last accepted heartbeat was signed (answered at once, with a
        #: session, even when it asked to be held).
        self.signed_last = False
        self._malformed = ""
        self._malformed_upgrade = ""
        #: The installation report the last request carried.
        self._installation: InstallationReport | None = None
        self._last_time_ns = 0
        #: The session requests are MACed with, if any, and when (time.monotonic())
        #: to stop using it and sign again, ahead of its end at the server.
        self.session: AgentSession | None = None
        self.session_until = 0.0
        import ssl
        import urllib.parse

        endpoint = init.bmaas_endpoint
        url = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        if url.scheme not in ("http", "https") or not url.hostname:
            raise AgentError(f"cannot use endpoint {endpoint!r}: want [https://]host[:port]")
        self.scheme, self.host = url.scheme, url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self._conn: http.client.HTTPConnection | None = None
        self.context: ssl.SSLContext | None = None
        if self.scheme == "https":
            try:
                self.context = ssl.create_default_context(cadata=init.ca_certificate or None)
            except (ssl.SSLError, ValueError) as exc:
                raise AgentError(f"cannot use ca_certificate: {exc}") from exc

    def request(self, hold: float = 0.0) -> tuple[bytes, dict[str, str]]:
        """The next request: body and headers, MACed with the session if one
        is held and still in use, else signed; asking the server to hold its
        answer up to ``hold`` seconds while it has nothing to answer."""
        report, warnings = self.report if self.report is not None else (None, None)
        installation = self.installer.pending_report() if self.installer is not None else None
        self._installation = installation
        upgrade = self.upgrader.pending_report() if self.upgrader is not None else None
        body = encode_heartbeat_request(
            self.init.machine_id, report, warnings, installation, upgrade
        )
        # Strictly increasing, also when the clock steps back: the server
        # refuses a time not newer than the last it accepted.
        now = max(time.time_ns(), self._last_time_ns + 1)
        self._last_time_ns = now
        if self.session is not None and time.monotonic() >= self.session_until:
            self.session = None
        headers = request_headers(
            self.init.machine_id,
            body,
            now,
            self.session,
            public_key=self.public_key,
            sign=lambda message: ed25519_sign(self.seed, message),
            hold=hold,
        )
        return body, headers

    def accepted(self, answer: bytes) -> None:
        """Take the session an accepted heartbeat's answer carries, if any.

        Used until 90% of its lifetime has passed (by this machine's
        monotonic clock, which the server's need not match closely), so that
        it is renewed by a signed heartbeat before the server refuses it. A
        token or key over its bound (`protocol.MAX_SESSION_TOKEN`,
        `protocol.MAX_SESSION_KEY`) is refused with a log line, and the
        session held before stays.
        """
        try:
            session = decode_heartbeat_session(answer)
        except DecodeError as exc:
            log(f"ignoring a malformed session: {exc}")
            return
        if session is None or not session.token or not session.key:
            return
        if len(session.token) > protocol.MAX_SESSION_TOKEN:
            log(
                f"ignoring a session token of {len(session.token)} bytes (over"
                f" {protocol.MAX_SESSION_TOKEN}): heartbeats stay signed"
            )
            return
        if len(session.key) > protocol.MAX_SESSION_KEY:
            log(
                f"ignoring a session key of {len(session.key)} bytes (over"
                f" {protocol.MAX_SESSION_KEY}): heartbeats stay signed"
            )
            return
        if 0 < session.lifetime_seconds < 2**62:
            self.session = session
            self.session_until = time.monotonic() + 0.9 * session.lifetime_seconds

    def take_installation(self, answer: bytes) -> None:
        """Tell the installer the installation request of an accepted answer.

        A malformed request is ignored (the installer is not told, so the
        last well-formed one stands) and said once in the log; heartbeats
        go on.
        """
        if self.installer is None:
            return
        try:
            request = decode_installation_request(answer)
        except DecodeError as exc:
            if str(exc) != self._malformed:
                log(f"ignoring a malformed installation request: {exc}")
                self._malformed = str(exc)
            return
        self._malformed = ""
        self.installer.on_answer(request)

    def take_upgrade(self, answer: bytes) -> None:
        """Tell the upgrader the upgrade request of an accepted answer; a
        malformed one is ignored and said once, as `take_installation` does."""
        if self.upgrader is None:
            return
        try:
            request = decode_upgrade_request(answer)
        except DecodeError as exc:
            if str(exc) != self._malformed_upgrade:
                log(f"ignoring a malformed upgrade request: {exc}")
                self._malformed_upgrade = str(exc)
            return
        self._malformed_upgrade = ""
        self.upgrader.on_answer(request)

    def _connect(self) -> http.client.HTTPConnection:
        from .deadline import connection

        return connection(self.host, self.port, self.context)

    def may_hold(self) -> bool:
        """Whether the next heartbeat may ask to be held: not while an
        install or an upgrade's step runs, whose outcome must go out as soon
        as it is ready (`wake`), which a held exchange could not."""
        if self.installer is not None and self.installer.busy():
            return False
        return self.upgrader is None or not self.upgrader.busy()

    def beat(self, hold: float = 0.0) -> None:
        """Send one heartbeat, asking the server to hold its answer up to
        ``hold`` seconds while it has nothing to answer (the long poll of
        `protocol.HEADER_HOLD`); raise OSError, HTTPException or AgentError
        on failure.

        The connection is kept for the next heartbeat (the server keeps idle
        connections longer than the interval), which spares both sides a
        TCP and TLS handshake per heartbeat. A kept connection the server
        closed meanwhile is replaced once, with a new request. A session
        the server refuses (expired, or made before the server restarted)
        is dropped and the heartbeat sent again at once, signed. Each
        exchange must complete within `REQUEST_TIMEOUT` (`deadline`). An
        answer that is not a ``200`` of ``application/proto`` (a proxy's
        page, say) fails the heartbeat, and its connection is closed.
        """
        import http.client

        from .deadline import start_exchange

        reconnected = resigned = False
        while True:
            reused = self._conn is not None
            if self._conn is None:
                self._conn = self._connect()
            conn = self._conn
            body, headers = self.request(hold)
            try:
                # The server answers a held heartbeat up to a sweep late.
                start_exchange(conn, REQUEST_TIMEOUT + (hold + HOLD_SLACK if hold > 0 else 0.0))
                conn.request("POST", protocol.HEARTBEAT_PATH, body=body, headers=headers)
                response = conn.getresponse()
                answer = response.read(MAX_ANSWER + 1)
            except (OSError, http.client.HTTPException):
                conn.close()
                self._conn = None
                if reused and not reconnected:
                    reconnected = True
                    continue
                raise
            content_type = response.getheader("Content-Type") or ""
            ours = response.status == 200 and _is_proto(content_type)
            if response.will_close or len(answer) > MAX_ANSWER or not ours:
                # Not an answer of ours: nothing more is read on this connection.
                conn.close()
                self._conn = None
            if response.status == 401 and protocol.HEADER_SESSION in headers and not resigned:
                log(f"session refused, signing again: {_quoted(answer)}")
                self.session = None
                resigned = True
                continue
            break
        if response.status != 200:
            raise AgentError(f"heartbeat refused: HTTP {response.status}: {_quoted(answer)}")
        if not ours:
            # A proxy's or a portal's page is no heartbeat answer: the
            # heartbeat (and the report it carries) did not reach the server.
            kind = _quoted(content_type.encode("latin-1", errors="replace"))
            raise AgentError(
                f"heartbeat answer of type '{kind}', not application/proto: {_quoted(answer)}"
            )
        if len(answer) > MAX_ANSWER:
            log(f"ignoring an answer of over {MAX_ANSWER} bytes")
        else:
            self.accepted(answer)
            self.signed_last = protocol.HEADER_SIGNATURE in headers
            if self.installer is not None and self._installation is not None:
                self.installer.sent(self._installation)
            self.take_installation(answer)
            self.take_upgrade(answer)
        if self.report is not None:
            log("hardware report accepted")
            self.report = None

    def run(self) -> None:
        """Heartbeat forever: every ``interval`` while accepted, else with
        exponential backoff (1 s doubling, jittered, up to ``backoff_cap``).

        Each heartbeat asks to be held up to ``interval`` (`may_hold`): a
        server that holds it answers as soon as it has a request for this
        machine, and the next heartbeat then goes out after what is left of
        the interval since this one went out (none, when it was held the
        whole interval); a server that answers at once gets one heartbeat
        an interval, as without holding. A signed heartbeat, which the
        server answers at once with a session, is followed at once by one
        with that session, which it can hold."""
        import http.client
        import random

        delay = 0.0
        failing = False
        while True:
            self.wake.clear()  # before the request is made: a later outcome wakes the next
            sent = time.monotonic()
            hold = self.interval if self.may_hold() else 0.0
            try:
                self.beat(hold)
            except (OSError, http.client.HTTPException, AgentError) as exc:
                delay = min(self.backoff_cap, max(1.0, delay * 2)) if failing else 1.0
                if not failing:
                    log(f"heartbeat failed, backing off: {exc}")
                failing = True
                time.sleep(delay * random.uniform(0.8, 1.0))
                continue
            if failing:
                log("heartbeats accepted again")
            failing = False
            delay = 0.0
            if hold and self.signed_last:
                continue  # the server holds only the session's heartbeats: the next one
            left = self.interval - (time.monotonic() - sent)
            if left > 0:
                self.wake.wait(left)  # or sooner, when an install's outcome is ready


def _is_proto(content_type: str) -> bool:
    """Whether a Content-Type is Connect's for a unary answer (application/proto)."""
    return content_type.split(";")[0].strip().lower() == "application/proto"


def _quoted(text: bytes) -> str:
    """The start of a server's text, fit for one log line: control and
    formatting characters escaped (a server must not write lines of its own
    into the agent's log, nor move a terminal's cursor)."""
    return repr(text[:300].decode("utf-8", errors="replace"))[1:-1]
