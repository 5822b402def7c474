"""The bytes of a HeartbeatResponse: the session a signed heartbeat gets,
and the stored requests an answer carries.

No message is built on this path: a stored request is already a
serialized message, embedded as it is (an embedded message is a
length-delimited field holding the message's bytes), and the fields are
put in canonical order (field 1, the session's field 100, field 101).
"""

from __future__ import annotations

from shepherd.agent import wire
from shepherd.agent_server.authenticate import Heartbeat
from shepherd.agent_server.session import SessionKeys
from shepherd.proto.agent_callback import HeartbeatResponse

#: The answer to an accepted session heartbeat that carries nothing.
EMPTY_RESPONSE = bytes(HeartbeatResponse())


def _length_delimited(key: bytes, payload: bytes) -> bytes:
    """A length-delimited field of ``key`` (its tag's bytes) holding ``payload``."""
    head = bytearray(key)
    length = len(payload)
    while length > 0x7F:
        head.append(length & 0x7F | 0x80)
        length >>= 7
    head.append(length)
    return bytes(head) + payload


def session_response(sessions: SessionKeys, beat: Heartbeat, now_ns: int) -> bytes:
    """The HeartbeatResponse to an accepted signed heartbeat: a new session."""
    token, key = sessions.issue(beat.machine_id, beat.key, now_ns)
    return wire.encode_heartbeat_session(wire.AgentSession(token, key, int(sessions.lifetime)))


def with_installation_request(response: bytes, request: bytes | None) -> bytes:
    """A HeartbeatResponse's bytes with ``installation_request`` (field 1) set to
    the serialized OSInstallationRequest ``request``, if given.

    Before the rest: ``response`` holds only higher fields, so field order
    stays canonical.
    """
    return response if request is None else _length_delimited(b"\x0a", request) + response


def with_upgrade_request(response: bytes, request: bytes | None) -> bytes:
    """A HeartbeatResponse's bytes with ``upgrade_request`` (field 101) set to
    the serialized UpgradeRequest ``request``, if given: after the rest, the
    highest field."""
    if request is None:
        return response
    return response + _length_delimited(b"\xaa\x06", request)  # field 101, length-delimited
