"""Agent sessions: one Ed25519 signature, then a MAC per heartbeat.

The reference authenticates an agent's key once per TLS connection (a
client certificate) and then relies on the channel's symmetric MAC. This
does the same at the message level, so that it also works behind a
TLS-terminating proxy: a heartbeat signed with the agent's key that the
server accepted is answered with a session (``HeartbeatResponse.session``,
field 100), and the agent authenticates its later heartbeats with an
HMAC-SHA256 under the session key instead of a signature, which costs the
server about a hundredth of a signature check::

    token       = version | machine id | agent public key | expiry | tag
    tag         = HMAC-SHA256(secret, TOKEN_CONTEXT | version..expiry)
    session key = HMAC-SHA256(secret, KEY_CONTEXT | token)

Stateless: a token carries everything the server needs, and only the
holder of ``secret`` can make one (the tag) or derive its key. So every
worker process holding the same secret accepts every session, with no
shared table; the supervisor makes the secret once and hands it to its
workers (`shepherd.agent_server.workers`). A restarted server makes a new
secret, its old tokens fail to verify, and agents sign again.

What a session heartbeat must still pass is what a signed one passes (see
`shepherd.agent_server.authenticate`): the MAC is over the same bytes as the
signature (`shepherd.agent.protocol.signed_message`: body, time, machine
id), with the same freshness window, and the BMDB statement checks the
token's public key against the machine's AgentStarted tag and the time
against the last accepted one. A machine taken over again (a new agent
key) thus refuses the old agent's sessions, and a captured session request
cannot be replayed.

Verified tokens are cached (bounded, per process) with their session key
and a keyed HMAC object: a session's later requests then cost a lookup, the
expiry check and one MAC from a copy of that object (`session_mac`), which
skips the key setup of a one-shot HMAC.

Over plain HTTP without a TLS-terminating proxy the session key travels in
the clear, as does every request; whoever reads it can heartbeat for that
machine until the session expires (`lifetime`) or the machine is taken
over again. Plain HTTP is for tests and for running behind such a proxy.
"""

from __future__ import annotations

import hmac
import secrets
import struct
import uuid
from dataclasses import dataclass

from shepherd.agent_server.connect import ConnectError

#: Default validity of a session, seconds: an agent signs once per this.
DEFAULT_LIFETIME = 3600.0

#: Bytes of a server secret made by `new_secret`.
SECRET_BYTES = 32

_VERSION = 1
_TOKEN_CONTEXT = b"monotrio-agent-session-token-v1\n"
_KEY_CONTEXT = b"monotrio-agent-session-key-v1\n"
# version, machine id (UUID bytes), agent public key, expiry (Unix seconds).
_FIELDS = struct.Struct(">B16s32sQ")
_TAG_BYTES = 32
#: Length of every token.
TOKEN_BYTES = _FIELDS.size + _TAG_BYTES


def new_secret() -> bytes:
    """A fresh random server secret."""
    return secrets.token_bytes(SECRET_BYTES)


#: Verified tokens kept per process (a fleet's worth; beyond, the cache starts over).
CACHE_SIZE = 65536


def session_mac(keyed: hmac.HMAC, message: bytes) -> bytes:
    """HMAC-SHA256 of ``message`` under the key ``keyed`` was made with,
    leaving ``keyed`` as it was (so that it serves the next message)."""
    mac = keyed.copy()
    mac.update(message)
    return mac.digest()


@dataclass(frozen=True)
class Session:
    """What a verified token says, and the session key derived from it."""

    machine_id: uuid.UUID
    #: The agent's Ed25519 public key the session was issued for.
    public_key: bytes
    #: The HMAC-SHA256 key of the session's requests.
    key: bytes
    #: When it ends, Unix seconds.
    expiry: int
    #: HMAC-SHA256 under `key`, never updated itself: see `session_mac`.
    mac: hmac.HMAC


class SessionKeys:
    """Issues and verifies session tokens under one server secret.

    ``lifetime`` is how long an issued session stays valid, seconds.
    """

    def __init__(self, secret: bytes, lifetime: float = DEFAULT_LIFETIME) -> None:
        if len(secret) < 16:
            raise ValueError("session secret must be at least 16 bytes")
        if lifetime <= 0:
            raise ValueError("session lifetime must be positive")
        self._secret = secret
        self.lifetime = lifetime
        self._verified: dict[bytes, Session] = {}

    def issue(self, machine_id: uuid.UUID, public_key: bytes, now_ns: int) -> tuple[bytes, bytes]:
        """(token, session key) of a new session for the machine's agent key."""
        expiry = now_ns // 1_000_000_000 + max(1, int(self.lifetime))
        fields = _FIELDS.pack(_VERSION, machine_id.bytes, public_key, expiry)
        token = fields + hmac.digest(self._secret, _TOKEN_CONTEXT + fields, "sha256")
        return token, hmac.digest(self._secret, _KEY_CONTEXT + token, "sha256")

    def open(self, token: bytes, now_ns: int) -> Session:
        """The session of a token; `ConnectError` ``unauthenticated`` if it is
        malformed, not made with this secret (forged, or from before a server
        restart) or expired, each with its own message."""
        session = self._verified.get(token)
        if session is None:
            session = self._verify(token)
            if len(self._verified) >= CACHE_SIZE:
                self._verified.clear()
            self._verified[token] = session
        if now_ns // 1_000_000_000 >= session.expiry:
            raise ConnectError("unauthenticated", "session expired")
        return session

    def _verify(self, token: bytes) -> Session:
        if len(token) != TOKEN_BYTES or token[0] != _VERSION:
            raise ConnectError("unauthenticated", "session token malformed")
        fields = token[: _FIELDS.size]
        tag = hmac.digest(self._secret, _TOKEN_CONTEXT + fields, "sha256")
        if not hmac.compare_digest(tag, token[_FIELDS.size :]):
            raise ConnectError(
                "unauthenticated", "session token not valid here (forged, or the server restarted)"
            )
        _, machine_bytes, public_key, expiry = _FIELDS.unpack(fields)
        key = hmac.digest(self._secret, _KEY_CONTEXT + token, "sha256")
        return Session(
            uuid.UUID(bytes=machine_bytes),
            public_key,
            key,
            expiry,
            hmac.new(key, digestmod="sha256"),
        )
