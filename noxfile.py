"""Developer sessions: ``nox -s tests lint typecheck`` is what CI runs.

Each session installs what it needs into its own virtualenv (uv when it is
available, virtualenv otherwise), so they work on a fresh machine. The system
services the tests start (PostgreSQL 15, etcd 3.4, OpenSSH sshd) come from
Debian packages; ``.ci/run`` installs them.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the test suite (pytest in Trio mode) against real services."""
    session.install("-e", ".[dev]")
    # Verbose, so that a CI log shows which tests ran, not just how many.
    args = session.posargs or ["-v", "--durations=10"]
    session.run("pytest", *args)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the packages, tests and benchmarks."""
    session.install("-e", ".[dev]")
    session.run("mypy")


@nox.session(python=PYTHON)
def proto(session: nox.Session) -> None:
    """Regenerate the committed protobuf classes from the .proto sources."""
    session.install("-e", ".[dev]")
    session.run("python", "-m", "tools.genproto")
