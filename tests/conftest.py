"""Root test configuration.

Fixtures that start real components live one per module in ``tests/fixtures/``
(``postgres.py``, ``etcd.py``, ``sshd.py``, ...). Every module there is loaded
as a pytest plugin, so any test can ask for any of them by name.
"""

from __future__ import annotations

import getpass
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = [
    f"tests.fixtures.{path.stem}"
    for path in sorted((Path(__file__).parent / "fixtures").glob("*.py"))
    if path.stem != "__init__"
]


#: Modules whose tests must run one after another in one process under
#: pytest-xdist (``-n``), by group.
#:
#: "fixed-address": they start nodes on the product's default loopback
#: addresses (127.0.0.N of `shepherd.localfleet`'s machines, 127.0.1.1 for
#: a first node) with the node's fixed ports, so two at once would collide.
#: A module that puts its nodes in its own process's block of addresses
#: instead (`tests.loopback`; the install rig does) needs no group: each
#: worker has its own block, and runs its tests one after another.
#:
#: "bench-smoke": the benchmarks' smoke runs, whose module-scoped fixture
#: starts two of them in the background for the module's tests (on one
#: worker, so that they run once).
SERIAL_GROUPS = {
    "tests/shepherd/test_demo.py": "fixed-address",
    "tests/bench/test_smoke.py": "bench-smoke",
    # The modules of nspawn machines, one after another on one worker: each
    # has one fleet for the module, whose tests build on each other's state
    # (a partition made, then read after a reboot; install, reboot, wipe in
    # turn; runs that build on the last), and in one group no two fleets
    # run side by side. Two or three at once (up to five machines, with
    # their nodes and etcds, each) loaded two cores past 10, and a rolling
    # upgrade under writes then waited on a node that stayed "unavailable"
    # until the test's 900 s bound.
    "tests/shepherd/nspawn/test_fleet.py": "nspawn",
    "tests/shepherd/nspawn/test_real_path.py": "nspawn",
    "tests/shepherd/nspawn/test_real_faults.py": "nspawn",
    "tests/shepherd/nspawn/test_real_demo.py": "nspawn",
    "tests/shepherd/nspawn/test_real_upgrade.py": "nspawn",
    "tests/shepherd/nspawn/test_ab_boots.py": "nspawn",
    # Checks that these groups reach xdist at all.
    "tests/test_xdist_groups.py": "group-check",
}


# First, so the marks are there when xdist's worker reads them in its own
# hook of this name (it writes each test's group into the node id).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, put each module of `SERIAL_GROUPS` in its group.

    With ``--dist loadgroup`` the tests of one ``xdist_group`` run on one
    worker; every other test goes wherever a worker is free.
    """
    if not config.pluginmanager.hasplugin("xdist"):
        return
    root = Path(str(config.rootpath))
    for item in items:
        group = SERIAL_GROUPS.get(item.path.relative_to(root).as_posix())
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, a base temp folder as short as pytest's own.

    A worker's ``tmp_path`` is ``<basetemp>/popen-gwN/<test name>``: with
    pytest's default base (``/tmp/pytest-of-USER/pytest-N``) etcd's client
    socket below a node root there (``.../n1/ephemeral/consensus/client.sock:0``)
    passed the 107 bytes a UNIX socket path may have, and etcd could not
    be reached. This base is as long as the default is without xdist.
    """
    controller = not hasattr(config, "workerinput")  # not an xdist worker
    if controller and getattr(config.option, "numprocesses", None) and not config.option.basetemp:
        base = Path(tempfile.gettempdir()) / f"pt-{getpass.getuser()}-{os.getpid()}"
        config.option.basetemp = str(base)
        config.stash[_XDIST_BASETEMP] = base


_XDIST_BASETEMP = pytest.StashKey[Path]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The short base folder goes when every test passed (kept to look at otherwise)."""
    base = session.config.stash.get(_XDIST_BASETEMP, None)
    if base is not None and exitstatus == 0:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _fixed_addresses_claimed(request: pytest.FixtureRequest) -> Iterator[None]:
    """A "fixed-address" module runs only while this process holds block 0.

    Its nodes use the product's default addresses, which no claim of
    `tests.loopback` covers: a second test run on the same host that reaches
    such a module while another run is in one is refused in one line, naming
    the other run, instead of colliding with it on the nodes' ports.
    """
    from tests import loopback

    path = Path(str(request.path)).relative_to(Path(str(request.config.rootpath))).as_posix()
    if SERIAL_GROUPS.get(path) != "fixed-address":
        yield
        return
    try:
        # Another worker of this run may hold it for a module of the group
        # (xdist can split a group across workers): wait for it.
        fd = loopback.claim_default_block(wait=900)
    except loopback.BlockHeld as held:
        pytest.fail(str(held), pytrace=False)
    try:
        yield
    finally:
        os.close(fd)
