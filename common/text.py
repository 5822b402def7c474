"""Text from outside (machines, agents, servers) made safe to store, log and print.

A hostile or broken machine controls parts of our error messages: an agent's
error text, its stderr, an SSH server's disconnect reason. Written unbounded
to the BMDB's history it bloats every row; printed raw to a terminal it can
move the cursor, rewrite earlier lines or forge log lines. :func:`printable`
escapes every control or formatting character and cuts the text to a
bounded length.
"""

from __future__ import annotations

__all__ = ["DEFAULT_LIMIT", "printable"]

#: Characters of a cause or log excerpt kept by default: enough for any
#: honest error message, small enough for a history row and a log line.
DEFAULT_LIMIT = 400

# Python's notion of printable: everything but the "Other" categories
# (controls, C1 included; formatting such as bidi overrides and zero-width
# joiners; surrogates; private use; unassigned) and separators other than the
# ASCII space (line and paragraph separators, look-alike spaces).
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    if char.isprintable():
        return char
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str, limit: int = DEFAULT_LIMIT) -> str:
    """``text`` with unsafe characters escaped (``\\x1b``, ``\\u202e``) and cut
    so that the result, escapes included, is at most ``limit`` characters
    plus a note of how many characters were left out.

    Pure; never raises.
    """
    # Most texts need no escape: one C-level pass says so (a table of
    # 1,000 machines prints 14,000 cells through here).
    if len(text) <= limit and text.isprintable():
        return text
    pieces: list[str] = []
    length = 0
    for index, char in enumerate(text):
        piece = _escape(char)
        if length + len(piece) > limit:
            return "".join(pieces) + f"... ({len(text) - index} more characters)"
        pieces.append(piece)
        length += len(piece)
    return "".join(pieces)
