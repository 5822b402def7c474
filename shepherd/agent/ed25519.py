"""Ed25519 in pure Python: public key derivation and signing (RFC 8032, 5.1.5-5.1.6).

Points are in extended homogeneous coordinates (X, Y, Z, T) with x = X/Z,
y = Y/Z, x*y = T/Z, using the unified addition formula (RFC 8032 5.1.4),
which is also correct for doubling. Not constant time: it runs on a machine
nobody else is using yet, once per key and once per signed heartbeat.

Why not ``ssh-keygen`` or a library: the target promises only ``python3``;
``ssh-keygen`` may be missing, and pulling the raw public key out of its
OpenSSH container format would be more code than deriving it. Tested
against ``cryptography`` and the RFC's test vectors.
"""

from __future__ import annotations

import hashlib

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


#: The order of the edwards25519 base point.
_L = 2**252 + 27742317777372353535851937790883648493


def _encode_point(p: _Point) -> bytes:
    x, y, z, _ = p
    z_inv = pow(z, _P - 2, _P)
    x, y = x * z_inv % _P, y * z_inv % _P
    return int.to_bytes(y | (x & 1) << 255, 32, "little")


def ed25519_sign(seed: bytes, message: bytes) -> bytes:
    """The 64-byte Ed25519 signature of ``message`` (RFC 8032 section 5.1.6).

    Deterministic, like every Ed25519 signer: the same key and message give
    the same signature, which the test vectors and ``cryptography`` check.
    """
    if len(seed) != 32:
        raise ValueError(f"Ed25519 seed must be 32 bytes, got {len(seed)}")
    digest = hashlib.sha512(seed).digest()
    scalar = int.from_bytes(digest[:32], "little")
    scalar &= (1 << 254) - 8
    scalar |= 1 << 254
    public = _encode_point(_scalar_mult(scalar, _BASE))
    r = int.from_bytes(hashlib.sha512(digest[32:] + message).digest(), "little") % _L
    big_r = _encode_point(_scalar_mult(r, _BASE))
    k = int.from_bytes(hashlib.sha512(big_r + public + message).digest(), "little") % _L
    return big_r + int.to_bytes((r + k * scalar) % _L, 32, "little")
