"""The strict decimal parser refuses everything Python's int() is lenient about."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.numbers import parse_decimal


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", 0), ("7", 7), ("0012", 12), (b"123", 123), ("9" * 19, int("9" * 19))],
)
def test_accepts_ascii_digits(text: str | bytes, value: int) -> None:
    assert parse_decimal(text, max_digits=19) == value


@pytest.mark.parametrize(
    "text",
    [
        "",
        "²",  # isdigit() but int() raises
        "¹2",
        "٣",  # int() accepts Arabic-Indic digits
        "\uff11\uff12",  # fullwidth digits, int() accepts
        " 12",
        "12 ",
        "+1",
        "-1",
        "1_000",
        "0x10",
        "1.5",
        "12\x00",
        b"\xb2",
        b"1\r\n",
        "9" * 20,
    ],
)
def test_refuses_anything_else(text: str | bytes) -> None:
    with pytest.raises(ValueError, match="malformed length"):
        parse_decimal(text, max_digits=19, what="length")


@given(st.text(max_size=30))
def test_any_text_is_a_value_or_a_valueerror(text: str) -> None:
    try:
        value = parse_decimal(text, max_digits=19)
    except ValueError:
        assert not (text.isascii() and text.isdigit() and 0 < len(text) <= 19)
    else:
        assert text.isascii() and text.isdigit() and value == int(text)


@given(st.binary(max_size=30))
def test_any_bytes_are_a_value_or_a_valueerror(raw: bytes) -> None:
    try:
        value = parse_decimal(raw, max_digits=19)
    except ValueError:
        return
    assert raw.isdigit() and int(raw) == value


def test_max_digits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_digits"):
        parse_decimal("1", max_digits=0)
