"""Developer sessions: ``nox -s tests lint typecheck`` is what CI runs.

Each session installs what it needs into its own virtualenv (uv when it is
available, virtualenv otherwise), so they work on a fresh machine. The system
services the tests start (PostgreSQL 15, etcd 3.4, OpenSSH sshd) come from
Debian packages; ``.ci/run`` installs them. ``nox -s bench`` runs the
benchmarks (not part of CI: they take minutes and want a quiet machine).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"

#: The project installed as a path on sys.path (setuptools' "compat" editable
#: mode, a .pth file naming this folder) rather than through an import hook:
#: the hook's module and what it imports (pathlib, re, importlib.util) ran in
#: every Python process at startup, about 10 ms of CPU each (21 ms against
#: 11.5 ms for ``python -c pass``, measured here), paid by every CLI call and
#: by each of the hundreds of processes the tests start.
EDITABLE = ("-e", ".[dev]", "--config-settings", "editable_mode=compat")


def _bytecode_cache(session: nox.Session) -> dict[str, str]:
    """The environment of the session's processes: bytecode cached under the
    virtualenv (its ``pycache`` folder), the project's sources compiled there.

    Where PYTHONDONTWRITEBYTECODE is set, as on these machines, nothing
    imported was cached: every Python process a test or benchmark starts
    (nodes, agents, CLIs) compiled the project's modules again, and those of
    the packages uv installed (uv does not compile at install). Python reads
    and writes bytecode under PYTHONPYCACHEPREFIX instead, mirroring each
    source's path; it writes what it compiles atomically, so the run's
    processes share it; the first import of an installed module compiles it
    once for the run. The source tree gets no ``__pycache__``, as the
    environment asks; the virtualenv is the session's own to write. A node's
    imports took 445 ms of CPU, 341 ms from this cache; the owner's 387 and
    271 (measured here). To run ``.nox/tests/bin/pytest`` directly as fast,
    export the two variables this returns.
    """
    env = {
        "PYTHONPYCACHEPREFIX": str(Path(session.virtualenv.location) / "pycache"),
        "PYTHONDONTWRITEBYTECODE": "",
    }
    session.run(
        "python",
        "-c",
        "import compileall; [compileall.compile_dir(d, quiet=2, workers=0) for d in"
        " ('metropolis', 'bmdb', 'shepherd', 'console', 'common', 'tests', 'bench')]",
        env=env,
        silent=True,
    )
    return env


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the test suite (pytest in Trio mode) against real services."""
    session.install(*EDITABLE)
    env = _bytecode_cache(session)
    # Verbose, so that a CI log shows which tests ran, not just how many.
    # Two workers (pytest-xdist), one per core. Four took the whole suite
    # from about 13 to about 10 minutes on such a machine (the tests mostly
    # wait on the processes they start), but at the load four make, a
    # Patroni failover once took longer than its bench's 120 s and a
    # rolling upgrade once stalled: two until those are understood.
    # Modules that must not run side by side share one worker through
    # their group in tests/conftest.py; each worker has its own block of
    # loopback addresses (tests/loopback.py).
    # ``nox -s tests -- tests/bmdb`` (any arguments) runs in one process.
    args = session.posargs or ["-v", "--durations=10", "-n", "2", "--dist", "loadgroup"]
    session.run("pytest", *args, env=env)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the packages, tests and benchmarks."""
    session.install(*EDITABLE)
    session.run("mypy")


@nox.session(python=PYTHON)
def proto(session: nox.Session) -> None:
    """Regenerate the committed protobuf classes from the .proto sources."""
    session.install(*EDITABLE)
    session.run("python", "-m", "tools.genproto")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Run every benchmark (or those named: ``nox -s bench -- web_pages``) and
    print their headline ratios as one table at the end.

    Each benchmark prints its own detailed table as it goes and reports its
    ratios through ``bench.ratios.report`` into the file this session names.
    Arguments that start with ``-`` go to every benchmark run: ``nox -s bench
    -- --smoke`` runs them all in seconds (see ``bench.smoke``).
    """
    session.install(*EDITABLE)
    env = _bytecode_cache(session)
    flags = [arg for arg in session.posargs if arg.startswith("-")]
    names = [arg for arg in session.posargs if not arg.startswith("-")] or [
        path.stem
        for path in sorted(Path("bench").glob("*.py"))
        if 'if __name__ == "__main__"' in path.read_text()
    ]
    with tempfile.TemporaryDirectory() as tmp:
        ratios = Path(tmp) / "ratios.jsonl"
        ratios.touch()
        for name in names:
            session.log(f"benchmark {name}")
            session.run(
                "python", "-m", f"bench.{name}", *flags, env={**env, "BENCH_RATIOS": str(ratios)}
            )
        rows = [json.loads(line) for line in ratios.read_text().splitlines()]
    reported = {row["bench"] for row in rows}
    width = max([len(f"{r['bench']}: {r['measure']}") for r in rows] + [20])
    print(f"\n{'benchmark: measure':<{width}}  {'ratio':>7}  goal")
    for row in rows:
        label = f"{row['bench']}: {row['measure']}"
        print(f"{label:<{width}}  {row['ratio']:>7.2f}  {row['goal']}")
    for name in names:
        if name not in reported:
            print(f"{name}: reported no ratio (see its own output above)")
