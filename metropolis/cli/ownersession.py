"""The owner's kept-open session, the serving side.

``python -m metropolis owner-session OPTIONS`` (started by an owner call
with ``--keep-open SECONDS``, see :mod:`metropolis.cli.ownerlink`) listens
on the UNIX socket of its options and runs the owner calls handed to it,
each as the same command in a process of its own would run it:

- the whole command line is parsed by the CLI's own parser, relative
  paths against the caller's folder; a line the parser refuses, or whose
  options are not this session's, is *declined* (the caller then runs it
  itself and prints the usage error);
- the owner's files (key, cluster file or node root) are read again for
  every call: a call sees the files as they are now. One connection to
  the curators is kept per distinct access they give (CA, curators, key),
  so an edited cluster file gets a connection of its own;
- what the call writes to stdout and stderr, then its exit code, go back
  to the caller as they happen; an error is the caller's one line, as
  the CLI prints it.

How requests are read, answered, cancelled, and when the session ends
is `common.keepopen.session`'s. Log lines go to ``<socket>.log`` beside
the socket, not to any caller.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from cryptography.hazmat.primitives import serialization

from common.cli import leaf_errors
from common.keepopen import session
from common.keepopen.session import Call, Say
from metropolis.cli import owner as owner_cli
from metropolis.cli import ownerlink
from metropolis.errors import MetropolisError
from metropolis.owner import Owner, OwnerAccess

__all__ = ["ErrorAnswer", "Parse", "main"]

#: The CLI's parser: argv (after ``metropolis``) to arguments; SystemExit
#: on a usage error.
Parse = Callable[[list[str]], argparse.Namespace]
#: An error of a call as the CLI reports it: its line (newline included)
#: and the exit code.
ErrorAnswer = Callable[[MetropolisError], tuple[str, int]]

#: Distinct accesses (CA, curators, key) a session keeps a connection for.
_MAX_ACCESSES = 8
#: The path arguments, made absolute against the caller's folder.
_PATH_ARGS = ("cluster", "root", "owner_key", "out")


def _identity(access: OwnerAccess) -> tuple[Any, ...]:
    """What makes two accesses the same connection: curators, CA, key, certificate."""
    raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
    der = serialization.Encoding.DER
    return (
        tuple(access.endpoints),
        access.ca_certificate.public_bytes(der),
        access.owner_key.public_key().public_bytes(*raw),
        access.certificate.public_bytes(der) if access.certificate else None,
    )


class _Owners:
    """The session's calls, on owner clients kept open in ``nursery``."""

    def __init__(
        self, key: str, parse: Parse, answer_error: ErrorAnswer, nursery: trio.Nursery
    ) -> None:
        self.key = key
        self.parse = parse
        self.answer_error = answer_error
        self.nursery = nursery
        self.owners: dict[tuple[Any, ...], Owner] = {}
        self.opening: dict[tuple[Any, ...], trio.Lock] = {}

    def accept(self, argv: list[str], cwd: str) -> Call | None:
        """The call of ``argv`` run in ``cwd``; None (declined) for a usage
        error or another session's options."""
        found = ownerlink.scan(argv)
        # Paths in the key are made absolute in the caller's folder.
        if found is None or found.key_in(cwd) != self.key:
            return None
        try:
            args = self.parse(argv)
        except SystemExit:
            return None  # a usage error: the caller's parser says it
        for name in _PATH_ARGS:
            value = getattr(args, name, None)
            if isinstance(value, Path) and not value.is_absolute():
                setattr(args, name, Path(cwd) / value)

        async def call(out: Say, err: Say) -> int:
            return await self._call(args, out, err)

        return call

    async def _owner_for(self, access: OwnerAccess, err: Say) -> Owner | None:
        """The kept owner client for ``access``, opened on first use (with
        the escrow, if due); None when the session keeps too many."""
        identity = _identity(access)
        lock = self.opening.setdefault(identity, trio.Lock())
        async with lock:
            if identity not in self.owners:
                if len(self.owners) >= _MAX_ACCESSES:
                    return None
                async with owner_cli.saying_waits("any", err):
                    await access.tls_context()
                self.owners[identity] = await self.nursery.start(_hold, access)
        return self.owners[identity]

    async def _call(self, args: argparse.Namespace, out: Say, err: Say) -> int:
        try:
            # The owner's files are read for each call: a call sees them as
            # they are now, as in a process of its own.
            access = owner_cli.owner_access(args)
            owner = await self._owner_for(access, err)
            if owner is None:
                err(
                    "metropolis: error: the owner session keeps too many clusters; "
                    "run the call without --keep-open\n"
                )
                return 1
            await owner_cli.call(args, owner, out, err)
        except MetropolisError as error:
            return self._report([error], err)
        except BaseExceptionGroup as group:
            # From a nursery inside the call (saying_waits): the CLI reports
            # each of our errors in it as one line, and so does the session.
            ours, rest = group.split(MetropolisError)
            if ours is None or rest is not None:
                raise
            return self._report(
                [e for e in leaf_errors(ours) if isinstance(e, MetropolisError)], err
            )
        return 0

    def _report(self, errors: list[MetropolisError], err: Say) -> int:
        code = 0
        for error in errors:
            line, code = self.answer_error(error)
            err(line)
        return code


async def _hold(
    access: OwnerAccess, *, task_status: trio.TaskStatus[Owner] = trio.TASK_STATUS_IGNORED
) -> None:
    async with access.open() as owner:
        task_status.started(owner)
        await trio.sleep_forever()


async def _serve(
    found: ownerlink.Scan, path: str, parse: Parse, answer_error: ErrorAnswer, keep_open: float
) -> None:
    async with trio.open_nursery() as nursery:
        owners = _Owners(found.key, parse, answer_error, nursery)
        await session.serve(path, keep_open, owners.accept)
        nursery.cancel_scope.cancel()


def main(prefix: list[str], parse: Parse, answer_error: ErrorAnswer) -> int:
    """``python -m metropolis owner-session OPTIONS``: serve until idle.

    Exit status 2 without ``--keep-open`` in OPTIONS or without a private
    folder for the socket.
    """
    args = parse(["owner", *prefix, "nodes"])
    found = ownerlink.scan(["owner", *prefix, "nodes"])
    path = None if found is None else found.session_path(create=True)
    if args.keep_open is None or found is None or path is None:
        return 2
    session.log_beside(path)
    trio.run(_serve, found, path, parse, answer_error, args.keep_open)
    return 0
