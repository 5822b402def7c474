#!/usr/bin/env python3
"""The takeover agent: the program the Shepherd initializer uploads and runs.

It runs on a freshly provided machine that may have nothing but ``python3``, so
this file is deliberately self-contained: standard library only, no imports
from the rest of the ``shepherd`` package, no third-party protobuf runtime.

Protocol (one exchange, then exit)::

    initializer --stdin-->  TakeoverInit {machine_id, bmaas_endpoint, ca_certificate}
                            |
                            v  validate (empty endpoint is refused)
                            v  load or create the Ed25519 key beside this file
    initializer <-stdout--  TakeoverResponse {success {init_message, key, warning*}}
                         or TakeoverResponse {error {message}}

The exit status is 0 whenever a ``TakeoverResponse`` was written, error or not:
the response is the result, and the initializer reads it whatever the status.

Key storage: the 32-byte Ed25519 private seed lives in ``<this file>.key``,
mode 0600, created atomically on first run and reused on every later run (the
key is the machine's identity towards the BMaaS endpoint, so it must survive
re-runs of the takeover). A key file that exists but is not 32 bytes is an
error, never silently replaced.

Why Ed25519 in pure Python instead of ``ssh-keygen``: the target promises only
``python3``; ``ssh-keygen`` may be missing, and pulling the raw public key out
of its OpenSSH container format would be more code than deriving it. Public
key derivation (RFC 8032, section 5.1.5) is one scalar multiplication over
edwards25519; it is tested against ``cryptography``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import os
import secrets
import stat
import sys

# --------------------------------------------------------------------------
# Protobuf wire codec for cloud.agent.api (see shepherd/proto/agent.proto).
#
# Only what the takeover messages use: varints, and length-delimited fields
# (strings, bytes, embedded messages). Encoding follows proto3 rules that every
# implementation shares: fields in field-number order, scalar fields with their
# default value (empty string/bytes) omitted, a set oneof member always written
# (even when empty). Decoding skips unknown fields of any wire type, and the
# last occurrence of a singular field wins, as the spec says.
# --------------------------------------------------------------------------

WIRE_VARINT = 0
WIRE_I64 = 1
WIRE_LEN = 2
WIRE_I32 = 5


class DecodeError(ValueError):
    """The bytes are not a valid encoding of the expected message."""


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _decode_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(data):
            raise DecodeError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise DecodeError("varint longer than 10 bytes")


def _len_field(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | WIRE_LEN) + _encode_varint(len(payload)) + payload


def iter_fields(data: bytes) -> list[tuple[int, int, bytes | int]]:
    """Split a message into (field number, wire type, value) triples."""
    fields: list[tuple[int, int, bytes | int]] = []
    pos = 0
    while pos < len(data):
        key, pos = _decode_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise DecodeError("field number 0")
        value: bytes | int
        if wire_type == WIRE_VARINT:
            value, pos = _decode_varint(data, pos)
        elif wire_type == WIRE_LEN:
            length, pos = _decode_varint(data, pos)
            if pos + length > len(data):
                raise DecodeError(f"field {number}: length {length} past end of message")
            value = data[pos : pos + length]
            pos += length
        elif wire_type == WIRE_I64:
            if pos + 8 > len(data):
                raise DecodeError(f"field {number}: truncated fixed64")
            value = data[pos : pos + 8]
            pos += 8
        elif wire_type == WIRE_I32:
            if pos + 4 > len(data):
                raise DecodeError(f"field {number}: truncated fixed32")
            value = data[pos : pos + 4]
            pos += 4
        else:
            raise DecodeError(f"field {number}: unsupported wire type {wire_type}")
        fields.append((number, wire_type, value))
    return fields


def _as_len(number: int, wire_type: int, value: bytes | int) -> bytes:
    if wire_type != WIRE_LEN or not isinstance(value, bytes):
        raise DecodeError(f"field {number}: wire type {wire_type}, want length-delimited")
    return value


def _as_str(number: int, wire_type: int, value: bytes | int) -> str:
    try:
        return _as_len(number, wire_type, value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"field {number}: string is not UTF-8") from exc


@dataclasses.dataclass(frozen=True)
class TakeoverInit:
    """cloud.agent.api.TakeoverInit."""

    machine_id: str = ""
    bmaas_endpoint: str = ""
    ca_certificate: bytes = b""

    def encode(self) -> bytes:
        out = b""
        if self.machine_id:
            out += _len_field(1, self.machine_id.encode("utf-8"))
        if self.bmaas_endpoint:
            out += _len_field(2, self.bmaas_endpoint.encode("utf-8"))
        if self.ca_certificate:
            out += _len_field(3, self.ca_certificate)
        return out

    @classmethod
    def decode(cls, data: bytes) -> TakeoverInit:
        machine_id, endpoint, ca = "", "", b""
        for number, wire_type, value in iter_fields(data):
            if number == 1:
                machine_id = _as_str(number, wire_type, value)
            elif number == 2:
                endpoint = _as_str(number, wire_type, value)
            elif number == 3:
                ca = _as_len(number, wire_type, value)
        return cls(machine_id, endpoint, ca)


def encode_success(init_message: bytes, key: bytes, warnings: list[str]) -> bytes:
    """TakeoverResponse{success: TakeoverSuccess{init_message, key, warning}}.

    ``init_message`` is an already encoded TakeoverInit, so the agent can echo
    exactly the bytes it was given.
    """
    success = _len_field(1, init_message)
    if key:
        success += _len_field(2, key)
    for warning in warnings:
        # Repeated fields write every element, empty ones included.
        success += _len_field(3, warning.encode("utf-8"))
    return _len_field(1, success)


def encode_error(message: str) -> bytes:
    """TakeoverResponse{error: TakeoverError{message}}."""
    error = _len_field(1, message.encode("utf-8")) if message else b""
    return _len_field(2, error)


# --------------------------------------------------------------------------
# Ed25519 public key derivation, RFC 8032 section 5.1.5.
#
# Points are in extended homogeneous coordinates (X, Y, Z, T) with x = X/Z,
# y = Y/Z, x*y = T/Z, using the unified addition formula (RFC 8032 5.1.4),
# which is also correct for doubling. Not constant time: it runs once per
# key on a machine nobody else is using yet.
# --------------------------------------------------------------------------

_P = 2**255 - 19
_D = -121665 * pow(121666, _P - 2, _P) % _P
_BY = 4 * pow(5, _P - 2, _P) % _P
_BX = 15112221349535400772501151409588531511454012693041857206046113283949847762202
_BASE = (_BX, _BY, 1, _BX * _BY % _P)

_Point = tuple[int, int, int, int]


def _point_add(p: _Point, q: _Point) -> _Point:
    a = (p[1] - p[0]) * (q[1] - q[0]) % _P
    b = (p[1] + p[0]) * (q[1] + q[0]) % _P
    c = 2 * p[3] * q[3] * _D % _P
    d = 2 * p[2] * q[2] % _P
    e, f, g, h = b - a, d - c, d + c, b + a
    return (e * f % _P, g * h % _P, f * g % _P, e * h % _P)


def _scalar_mult(scalar: int, point: _Point) -> _Point:
    result: _Point = (0, 1, 1, 0)  # the neutral element
    while scalar:
        if scalar & 1:
            result = _point_add(result, point)
        point = _point_add(point, point)
        scalar >>= 1
    return result


def ed25519_public_key(seed: bytes) -> bytes:
    """Return the 32-byte Ed25519 public key for a 32-byte private seed."""
    if len(seed) != 32:
        raise ValueError(f"Ed25519 seed must be 32 bytes, got {len(seed)}")
    digest = hashlib.sha512(seed).digest()
    scalar = int.from_bytes(digest[:32], "little")
    scalar &= (1 << 254) - 8  # clear the 3 low bits and bit 255
    scalar |= 1 << 254
    x, y, z, _ = _scalar_mult(scalar, _BASE)
    z_inv = pow(z, _P - 2, _P)
    x, y = x * z_inv % _P, y * z_inv % _P
    return int.to_bytes(y | (x & 1) << 255, 32, "little")


# --------------------------------------------------------------------------
# The key file and the program.
# --------------------------------------------------------------------------


class AgentError(Exception):
    """A failure the agent reports to the initializer as TakeoverError."""


def load_or_create_seed(path: str, warnings: list[str]) -> bytes:
    """Return the private seed stored at ``path``, creating it if absent.

    The file must be a regular file owned by us: opened without following a
    symlink (one planted at the path is refused, never read or chmodded
    through), checked and tightened through its descriptor. Creation writes
    an unpredictably named temporary file (exclusive create, 0600) and links
    it into place, which fails if the key appeared meanwhile (then that one
    is used): a crash never leaves a truncated key, and two agents starting
    at once agree on one key. Every failure is an :class:`AgentError`.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return _create_seed(path, warnings)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise AgentError(f"key file {path} is a symbolic link; refusing it") from exc
        raise AgentError(f"cannot read key file {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AgentError(f"key file {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise AgentError(f"key file {path} is owned by uid {st.st_uid}, not by us")
        seed = os.read(fd, 33)
        if len(seed) != 32:
            raise AgentError(f"key file {path} holds {st.st_size} bytes, want 32; not replacing it")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            os.fchmod(fd, 0o600)
            warnings.append(f"key file {path} had mode {mode:04o}, tightened to 0600")
        return seed
    except OSError as exc:
        raise AgentError(f"cannot read key file {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def _create_seed(path: str, warnings: list[str]) -> bytes:
    seed = os.urandom(32)
    tmp = f"{path}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except OSError as exc:
        raise AgentError(f"cannot create key file {path}: {exc.strerror}") from exc
    try:
        try:
            os.write(fd, seed)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        return load_or_create_seed(path, warnings)  # another run created it: use that
    except OSError as exc:
        raise AgentError(f"cannot create key file {path}: {exc.strerror}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return seed


def key_path() -> str:
    """The key file lives beside the agent: ``<agent path>.key``."""
    return os.path.abspath(sys.argv[0]) + ".key"


def take_over(init_bytes: bytes, key_file: str) -> bytes:
    """Run one takeover exchange and return the encoded TakeoverResponse."""
    try:
        init = TakeoverInit.decode(init_bytes)
    except DecodeError as exc:
        return encode_error(f"malformed TakeoverInit on stdin: {exc}")
    if not init.bmaas_endpoint:
        return encode_error("TakeoverInit has an empty bmaas_endpoint")
    warnings: list[str] = []
    try:
        seed = load_or_create_seed(key_file, warnings)
    except AgentError as exc:
        return encode_error(str(exc))
    return encode_success(init_bytes, ed25519_public_key(seed), warnings)


def main() -> int:
    response = take_over(sys.stdin.buffer.read(), key_path())
    sys.stdout.buffer.write(response)
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
