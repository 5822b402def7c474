"""Numbers from outside (HTTP headers, gRPC metadata, query strings) parsed strictly.

Python's ``int()`` is made for people, not for protocols: it accepts any
Unicode decimal digit (``int("٣") == 3``), surrounding whitespace, a sign
and underscores (``int(" +1_0 ") == 10``), and ``str.isdigit()`` is true for
characters ``int()`` then refuses (``"²".isdigit()`` but ``int("²")``
raises). A wire format means ASCII ``0``-``9`` and nothing else, so every
numeric header or field a peer sends goes through :func:`parse_decimal`,
which accepts exactly that, up to a bounded number of digits, and raises
one exception type for everything else.
"""

from __future__ import annotations

__all__ = ["parse_decimal"]

_DIGITS = frozenset(b"0123456789")


def parse_decimal(text: str | bytes, *, max_digits: int, what: str = "number") -> int:
    """The non-negative integer spelled by ``text`` in ASCII decimal digits.

    ``text`` must be 1 to ``max_digits`` characters, each ``0``-``9``: no
    sign, space, underscore or other Unicode digit. Leading zeros are
    allowed (HTTP allows them in Content-Length). Raises ``ValueError``
    naming ``what`` otherwise. Pure; never raises anything else.
    """
    if max_digits < 1:
        raise ValueError(f"max_digits must be at least 1, not {max_digits}")
    if isinstance(text, str):
        if not text.isascii():
            raise ValueError(f"malformed {what}: not ASCII digits")
        raw = text.encode("ascii")
    else:
        raw = bytes(text)
    if not raw:
        raise ValueError(f"malformed {what}: empty")
    if len(raw) > max_digits:
        raise ValueError(f"malformed {what}: more than {max_digits} digits")
    if not _DIGITS.issuperset(raw):
        raise ValueError(f"malformed {what}: not ASCII digits")
    return int(raw)
