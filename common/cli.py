"""How every command-line tool ends: one clean line per error, no traceback for
the errors we expect, and a quiet exit when the reader of our output goes away.

Structured concurrency wraps errors in exception groups, often nested (Trio's
nursery inside trio-asyncio's loop inside ours), so what reaches ``main`` is
rarely the error itself. :func:`leaf_errors` flattens a group to the errors it
carries; :func:`run_main` runs a CLI's body and reports them::

    def main(argv=None) -> int:
        return run_main("bmdb", lambda: _main(argv), known=(BMDBError,))

A leaf that is an instance of one of ``known`` (a package's error root: its
message is written for the operator) is printed as ``prog: error: message``.
Any other leaf is a bug and is printed with its traceback. ``BrokenPipeError``
(``bmdb history ... | head``) ends the program silently with status 141, as
a program killed by SIGPIPE would.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from common.exitcodes import ExitCode

_Options = TypeVar("_Options")

__all__ = ["BROKEN_PIPE_STATUS", "error_line", "leaf_errors", "run_main"]

#: 128 + SIGPIPE: what a shell reports for a C program that wrote to a closed pipe.
BROKEN_PIPE_STATUS = 141


def leaf_errors(exc: BaseException) -> list[BaseException]:
    """The non-group exceptions inside ``exc``, depth first, in order.

    ``exc`` itself if it is not a group. Groups nested at any depth are
    flattened; an empty list is impossible (a group always holds at least one).
    """
    if not isinstance(exc, BaseExceptionGroup):
        return [exc]
    leaves: list[BaseException] = []
    for inner in exc.exceptions:
        leaves.extend(leaf_errors(inner))
    return leaves


def _silence_stdout() -> None:
    # Python flushes stdout again at exit; pointing the descriptor at
    # /dev/null keeps that flush from raising a second BrokenPipeError.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass  # no real stdout (replaced in tests): nothing will flush to the pipe


def run_main(
    prog: str,
    body: Callable[[], int],
    *,
    known: tuple[type[BaseException], ...],
    labels: Sequence[tuple[type[BaseException], str]] = (),
    try_again: tuple[type[BaseException], ...] = (),
) -> int:
    """Run ``body`` (a CLI's work; returns its exit status) and report its errors.

    Returns ``body``'s status, 1 if it raised (after printing every leaf error
    on stderr, one line each, or a traceback for a leaf not in ``known``), or
    :data:`BROKEN_PIPE_STATUS` if stdout was closed by its reader.
    ``KeyboardInterrupt`` and ``SystemExit`` (argparse's exit) propagate
    unchanged, also from inside a group, so Ctrl-C and usage errors behave
    as usual. ``labels`` name where a known error came from: the first
    entry whose type matches replaces ``error`` in ``prog: error: message``
    (e.g. ``shepherd: Equinix: ...`` for a provider's error). If every
    leaf is one of ``try_again`` (a "not yet"), the status is
    `ExitCode.TRY_AGAIN` instead of 1 (`common.exitcodes`).
    """
    try:
        status = body()
        # Inside the try: a closed pipe often only shows when the buffered
        # output is flushed.
        sys.stdout.flush()
        return status
    except BaseException as exc:
        leaves = leaf_errors(exc)
        for leaf in leaves:
            if isinstance(leaf, KeyboardInterrupt | SystemExit):
                raise leaf from None
        if all(isinstance(leaf, BrokenPipeError) for leaf in leaves):
            _silence_stdout()
            return BROKEN_PIPE_STATUS
        _report(prog, leaves, known, labels)
        if try_again and all(isinstance(leaf, try_again) for leaf in leaves):
            return ExitCode.TRY_AGAIN
        return ExitCode.FAILED


#: How the tools' log lines look: time, level, logger, message.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_to_stderr(verbose: bool, *, quiet: int | None = None) -> None:
    """Log to stderr: everything with ``verbose``, else from level ``quiet``
    (None: INFO) up. Imports :mod:`logging` only when called."""
    import logging

    level = logging.DEBUG if verbose else logging.INFO if quiet is None else quiet
    logging.basicConfig(level=level, format=LOG_FORMAT)


def run_trio_command(
    prog: str,
    run: Callable[[_Options], Awaitable[int]],
    options: _Options,
    *,
    verbose: bool,
    known: tuple[type[BaseException], ...],
) -> int:
    """A command whose work is ``run(options)`` under Trio: warnings and
    errors logged (everything with ``verbose``), its errors reported by
    :func:`run_main`; the exit status."""
    import logging

    import trio

    log_to_stderr(verbose, quiet=logging.WARNING)
    return run_main(prog, lambda: trio.run(run, options), known=known)


def error_line(
    prog: str,
    error: BaseException,
    labels: Sequence[tuple[type[BaseException], str]] = (),
) -> str:
    """``prog: error: message`` for a known error, on one line whatever the
    message holds (a server's multi-line diagnostic, say); ``labels`` as
    :func:`run_main`'s."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    message = "; ".join(lines) or type(error).__name__
    label = next((name for kind, name in labels if isinstance(error, kind)), "error")
    return f"{prog}: {label}: {message}"


def _report(
    prog: str,
    leaves: list[BaseException],
    known: tuple[type[BaseException], ...],
    labels: Sequence[tuple[type[BaseException], str]],
) -> None:
    # Cancelled is what sibling tasks see when another one fails: noise
    # next to the error that caused it. Imported here, on the error path:
    # a command that needs no Trio (--help) does not import it for this.
    import trio

    real = [leaf for leaf in leaves if not isinstance(leaf, trio.Cancelled)] or leaves
    for leaf in real:
        if isinstance(leaf, known):
            print(error_line(prog, leaf, labels), file=sys.stderr)
        else:
            print(f"{prog}: internal error (a bug), please report:", file=sys.stderr)
            traceback.print_exception(leaf, file=sys.stderr)
    sys.stderr.flush()
