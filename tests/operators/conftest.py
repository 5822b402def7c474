"""The operator tests' browser: one chromium for the whole session (see `browser`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.operators.browser import Chromium


@pytest.fixture(scope="session")
def chromium() -> Iterator[Chromium]:
    """Started by the first test that asks, closed when the session ends."""
    with Chromium.started() as browser:
        yield browser
