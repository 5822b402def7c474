"""What the agent and the agent callback server must agree on, beyond the messages.

Transport: Connect's unary protocol over HTTP/1.1 (POST, application/proto,
the bare message as body; errors as JSON {code, message}), because
http.client speaks it and HTTP/2 (gRPC) is not in the standard library.

Authentication: the TLS layer only authenticates the server. The agent signs
a request with its Ed25519 key over `signed_message`; the server checks the
signature against the key in the machine's AgentStarted tag, that the time
is fresh, and that it is newer than the last accepted one (so a captured
request cannot be replayed). An accepted signed request is answered with a
session (HeartbeatResponse.session: an opaque token and an HMAC-SHA256 key),
and the agent authenticates its next requests with `session_mac` under that
key over the same bytes instead of a signature, far cheaper for the server,
until the session ends (its lifetime, or a refusal: the agent then signs
again).

Long poll: a heartbeat may ask the server to hold its answer while there
is nothing to answer (`HEADER_HOLD`); the agent then sends its next one
as soon as a held answer comes, so a request reaches it at once instead of
at its next heartbeat, and heartbeats still come once an interval.

Standard library only, like all of the agent: the server imports this
module too, so that both sides take the names and the layout from one place.
"""

from __future__ import annotations

import hashlib
import hmac

HEARTBEAT_PATH = "/cloud.bmaas.server.api.AgentCallback/Heartbeat"
SIGNATURE_CONTEXT = b"monotrio-agent-callback-v1"
HEADER_KEY = "Monotrio-Agent-Key"
HEADER_TIME = "Monotrio-Agent-Time"
HEADER_SIGNATURE = "Monotrio-Agent-Signature"
#: A session's token (base64), instead of HEADER_KEY and HEADER_SIGNATURE.
HEADER_SESSION = "Monotrio-Agent-Session"
#: HMAC-SHA256 (base64) of signed_message under the session key.
HEADER_MAC = "Monotrio-Agent-Mac"
#: How long the server may hold the answer to this heartbeat, in
#: milliseconds (ASCII digits), when it has no request for the agent: it
#: answers as soon as one is written, or empty when the time is up (the
#: long poll of `shepherd.agent_server.hold`). Not signed: it changes
#: only when the agent hears, never what. Absent: answered at once.
HEADER_HOLD = "Monotrio-Agent-Hold-Ms"
#: Largest session token and session key an agent takes from a server, bytes.
#: The server's are 89 and 32 bytes (`shepherd.agent_server.session`); the
#: agent sends the token back in a header of every request, so one of any
#: size (a hostile or broken server's megabyte) would make every request's
#: head too large for any server to take. An agent given a larger one logs
#: it, keeps no session and signs its heartbeats.
MAX_SESSION_TOKEN = 1024
MAX_SESSION_KEY = 64


def signed_message(method: str, path: str, machine_id: str, time_ns: int, body: bytes) -> bytes:
    """The bytes an agent signs for one request: everything that makes it unique."""
    return b"\n".join(
        [
            SIGNATURE_CONTEXT,
            method.encode("ascii"),
            path.encode("utf-8"),
            machine_id.encode("utf-8"),
            str(time_ns).encode("ascii"),
            hashlib.sha256(body).hexdigest().encode("ascii"),
        ]
    )


def session_mac(key: bytes, message: bytes) -> bytes:
    """The MAC of a session request: HMAC-SHA256 under the session key of
    signed_message's bytes."""
    return hmac.digest(key, message, "sha256")
