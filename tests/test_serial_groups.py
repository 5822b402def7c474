"""Every test module that starts nodes on the fixed loopback addresses is in
the "fixed-address" group of tests/conftest.py, so that pytest-xdist never
runs two of them at once (their nodes would collide on the fixed ports),
unless it puts its nodes in its own process's block of addresses
(`tests.loopback`), which every worker has to itself.

A module is taken to start nodes on those addresses when it uses the
install rig, the local first node or the demo: the three ways a test puts
nodes there. The install rig puts them in the block.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shepherd.localfleet import first_node_address, loopback_addresses
from tests import loopback
from tests.conftest import SERIAL_GROUPS
from tests.fixtures import install_rig

TESTS = Path(__file__).parent
#: What a module that starts nodes on the fixed addresses names.
SIGNS = ("tests.fixtures.install_rig", "shepherd.localcluster", "shepherd.demo")
#: What a module that puts its nodes in its process's block names.
IN_BLOCK = ("tests.fixtures.install_rig", "tests.loopback", "from tests import loopback")
#: Modules that name the demo but start no node: its --help, usage errors,
#: and the names its lazy module offers.
NO_NODES = {
    "tests/test_cli_help.py",
    "tests/test_exit_codes.py",
    "tests/test_cli_imports.py",
    "tests/common/test_lazy.py",
}


def test_every_module_on_the_fixed_addresses_is_in_their_group_or_its_block() -> None:
    using = {
        path.relative_to(TESTS.parent).as_posix(): path.read_text()
        for path in TESTS.rglob("test_*.py")
        if path.name != Path(__file__).name and any(sign in path.read_text() for sign in SIGNS)
    }
    using = {m: text for m, text in using.items() if m not in NO_NODES}
    assert using, "no module found: the signs are out of date"
    missing = [
        m
        for m, text in sorted(using.items())
        if SERIAL_GROUPS.get(m) != "fixed-address" and not any(s in text for s in IN_BLOCK)
    ]
    assert missing == [], f"add these to SERIAL_GROUPS as fixed-address: {missing}"


def test_every_grouped_module_exists() -> None:
    assert [m for m in SERIAL_GROUPS if not (TESTS.parent / m).is_file()] == []


def test_each_worker_has_a_block_of_its_own_and_none_has_the_default() -> None:
    blocks = [loopback.worker_block(f"gw{i}") for i in range(8)]
    assert blocks == list(range(1, 9))
    assert loopback.worker_block("") == 1  # one process, without xdist
    with pytest.raises(ValueError, match="no loopback block left"):
        loopback.worker_block("gw255")
    fleets = [set(loopback_addresses(254, block=b)) | {first_node_address(b)} for b in blocks]
    assert all(a.isdisjoint(b) for i, a in enumerate(fleets) for b in fleets[i + 1 :])
    assert install_rig.FIRST == loopback.FIRST == first_node_address(loopback.BLOCK)
    assert loopback.fleet_hosts(2) == loopback_addresses(2, block=loopback.BLOCK)
    assert loopback.BLOCK != 0


def test_a_block_held_by_another_run_is_skipped_and_freed_when_it_ends(tmp_path: Path) -> None:
    # Another run: a child process that claims block 5 and waits.
    import subprocess
    import sys

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys; from pathlib import Path; from tests import loopback;"
                f"b, _ = loopback.claim_block(5, lock_dir=Path({str(tmp_path)!r}));"
                "print(b, flush=True); sys.stdin.read()"
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=TESTS.parent,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "5"
        block, fd = loopback.claim_block(5, lock_dir=tmp_path)
        assert block == 6  # 5 is the other run's
        os.close(fd)
    finally:
        child.communicate("")
    block, fd = loopback.claim_block(5, lock_dir=tmp_path)  # its end freed it
    assert block == 5
    os.close(fd)


def test_the_default_block_held_by_another_run_is_refused_naming_it(tmp_path: Path) -> None:
    fd = loopback.claim_default_block(lock_dir=tmp_path)
    try:
        # flock is per open file: a second open in this process is "another run".
        with pytest.raises(
            loopback.BlockHeld, match=rf"another test run \(pid {os.getpid()}, run in "
        ):
            loopback.claim_default_block(lock_dir=tmp_path)
    finally:
        os.close(fd)
    os.close(loopback.claim_default_block(lock_dir=tmp_path))
