"""Every test module that starts nodes on the fixed loopback addresses is in
the "fixed-address" group of tests/conftest.py, so that pytest-xdist never
runs two of them at once (their nodes would collide on the fixed ports).

A module is taken to do so when it uses the install rig, the local first
node or the demo: the three ways a test puts nodes on those addresses.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SERIAL_GROUPS

TESTS = Path(__file__).parent
#: What a module that starts nodes on the fixed addresses names.
SIGNS = ("tests.fixtures.install_rig", "shepherd.localcluster", "shepherd.demo")


def test_every_module_on_the_fixed_addresses_is_in_their_group() -> None:
    using = sorted(
        path.relative_to(TESTS.parent).as_posix()
        for path in TESTS.rglob("test_*.py")
        if path.name != Path(__file__).name and any(sign in path.read_text() for sign in SIGNS)
    )
    assert using, "no module found: the signs are out of date"
    missing = [m for m in using if SERIAL_GROUPS.get(m) != "fixed-address"]
    assert missing == [], f"add these to SERIAL_GROUPS as fixed-address: {missing}"


def test_every_grouped_module_exists() -> None:
    assert [m for m in SERIAL_GROUPS if not (TESTS.parent / m).is_file()] == []
