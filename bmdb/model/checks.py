"""The argument checks of the BMDB's statements: what `Queries` refuses
before the database sees it.

Every domain's statements (`bmdb.model.machines`, `agents`, `installs`,
...) take machine ids, limits, times and texts alike, so they check them
alike: each check raises `InvalidArgument` naming the bad value, and the
surrounding transaction is rolled back, leaving the database as it was.
"""

from __future__ import annotations

import datetime
import uuid

from bmdb.errors import InvalidArgument


def as_uuid(value: uuid.UUID | str) -> uuid.UUID:
    """``value`` as a UUID; `InvalidArgument` if it is not one."""
    if isinstance(value, uuid.UUID):
        return value
    if isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            pass
    raise InvalidArgument(f"not a machine id (UUID): {value!r}")


#: Longest text stored with an installation request or report (characters).
MAX_INSTALLATION_TEXT = 4096


def check_text(name: str, value: str) -> None:
    """`InvalidArgument` unless ``value`` is text PostgreSQL can store (no
    NUL) of at most `MAX_INSTALLATION_TEXT` characters."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be text, got {type(value).__name__}")
    if "\x00" in value:
        raise InvalidArgument(f"{name} holds a NUL character, which PostgreSQL cannot store")
    if len(value) > MAX_INSTALLATION_TEXT:
        raise InvalidArgument(f"{name} is over {MAX_INSTALLATION_TEXT} characters")


def check_limit(limit: int) -> int:
    """``limit``, if it is a positive integer; else `InvalidArgument`."""
    if not isinstance(limit, int) or limit < 1:
        raise InvalidArgument(f"limit must be a positive integer, got {limit!r}")
    return limit


def check_aware(at: datetime.datetime) -> datetime.datetime:
    """``at``, if it is a timezone-aware datetime; else `InvalidArgument`."""
    if not isinstance(at, datetime.datetime) or at.tzinfo is None:
        raise InvalidArgument(f"need a timezone-aware datetime, got {at!r}")
    return at


def check_generation(generation: int) -> None:
    """`InvalidArgument` unless ``generation`` is an integer from 1 to
    2**63 - 1 (a request's generation, stored as a bigint)."""
    if not isinstance(generation, int) or not 0 < generation < 2**63:
        raise InvalidArgument(f"generation must be a positive integer, got {generation!r}")


def check_node_key(key: bytes) -> None:
    """`InvalidArgument` unless ``key`` is a node's raw Ed25519 public key (32 bytes)."""
    if len(key) != 32:
        raise InvalidArgument(f"node public key is {len(key)} bytes, want 32 (raw Ed25519)")
