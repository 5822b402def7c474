"""Argument types the command-line tools share (for argparse's ``type=``):
each turns the text into its value or raises ``argparse.ArgumentTypeError``
with a message the parser prints after the option's name."""

from __future__ import annotations

import argparse

__all__ = ["positive_seconds"]


def positive_seconds(text: str) -> float:
    """A finite number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value
