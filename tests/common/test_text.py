"""common.text.printable: machine text made safe to store, log and print."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from common.text import printable


def test_escapes_controls_and_formatting() -> None:
    assert printable("a\x1b[2Jb\nc\u202ed\x00\x7f\x85") == "a\\x1b[2Jb\\nc\\u202ed\\x00\\x7f\\x85"
    assert printable("plain, ünïcode ✓") == "plain, ünïcode ✓"


def test_cuts_long_text_and_says_so() -> None:
    assert printable("x" * 1000, limit=10) == "x" * 10 + "... (990 more characters)"
    # The bound holds for the escaped form: escapes do not blow past it.
    assert printable("\x1b" * 100, limit=12) == "\\x1b" * 3 + "... (97 more characters)"


@given(st.text(), st.integers(0, 50))
def test_result_is_bounded_and_printable(text: str, limit: int) -> None:
    out = printable(text, limit)
    assert out.isprintable()
    assert len(out) <= limit + len(f"... ({len(text)} more characters)")
    if text.isprintable() and len(text) <= limit:
        assert out == text
