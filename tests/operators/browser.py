"""Driving Debian's chromium with Playwright from Trio tests.

Playwright's Python API runs on asyncio; a scenario is run with
``asyncio.run`` in a worker thread, so the Trio test (and the web server it
serves in its own nursery) keeps running meanwhile. Playwright's own browser
download is not used: the Debian package's ``/usr/bin/chromium`` is.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import trio
from playwright.async_api import Browser, async_playwright

T = TypeVar("T")

CHROMIUM = "/usr/bin/chromium"


def require_chromium() -> None:
    if shutil.which(CHROMIUM) is None:
        pytest.fail(f"{CHROMIUM} missing: apt-get install chromium (see .ci/run)")


async def in_browser(scenario: Callable[[Browser], Awaitable[T]]) -> T:
    """Run ``scenario(browser)`` against a headless chromium; its result."""
    require_chromium()

    async def main() -> T:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                return await scenario(browser)
            finally:
                await browser.close()

    return await trio.to_thread.run_sync(asyncio.run, main())
