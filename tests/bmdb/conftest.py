"""The BMDB suite runs without an asyncio loop, so that it shows, test by
test, that the BMDB needs none (`bmdb._pg` drives psycopg with Trio's own I/O).

A fixture that opened one (``aio_loop``, a trio-asyncio loop) would hide a
dependency on asyncio creeping back in; this guard fails any BMDB test that
asks for it, directly or through another fixture.
"""

from __future__ import annotations

import pytest

#: Fixtures that open an asyncio loop (tests/fixtures/aio.py).
ASYNCIO_FIXTURES = {"aio_loop"}


@pytest.fixture(autouse=True)
def _no_asyncio_loop(request: pytest.FixtureRequest) -> None:
    opened = ASYNCIO_FIXTURES.intersection(request.fixturenames)
    if opened:
        pytest.fail(f"BMDB tests must run without an asyncio loop, but use {sorted(opened)}")
