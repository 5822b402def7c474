"""The groups of tests/conftest.py reach pytest-xdist.

xdist's worker reads each test's ``xdist_group`` mark in its own
``pytest_collection_modifyitems`` and appends the group to the node id,
which is what ``--dist loadgroup`` schedules by. Marks added by a hook
that runs after xdist's are never seen: the groups then silently split
over the workers. This module is in a group of its own, so under
``-n N --dist loadgroup`` its node id must carry it.
"""

from __future__ import annotations

import pytest

from tests.conftest import SERIAL_GROUPS


def test_this_module_carries_its_group_in_its_node_id(request: pytest.FixtureRequest) -> None:
    config = request.config
    if not getattr(config.option, "loadgroup", False):  # set on a worker by xdist
        pytest.skip("only under pytest-xdist's --dist loadgroup")
    group = SERIAL_GROUPS["tests/test_xdist_groups.py"]
    assert request.node.nodeid.endswith(f"@{group}"), request.node.nodeid
