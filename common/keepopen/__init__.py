"""Kept-open sessions for command-line tools, as ssh's ``ControlPersist``.

A CLI call that must import a protocol stack and connect before it can
ask anything pays for that in every process. With ``--keep-open
SECONDS``, the first call also starts a *session* process that keeps the
imports (and, where the tool wants, its connections); later calls with
the same options hand their command line to it over a UNIX socket and
print what it answers, exit code included.

- `common.keepopen.link`: the calling side and the wire (standard library
  only, imported before anything else of a command);
- `common.keepopen.session`: the serving side (Trio).

Each tool decides which of its commands go to a session, what names a
session (its key: the options that choose what it connects to), and how
a call runs there: ``metropolis owner`` (`metropolis.cli.ownerlink`) and
``bmdb``'s listings (`bmdb.cli.viewlink`).
"""
