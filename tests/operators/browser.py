"""Driving Debian's chromium with Playwright from Trio tests, one browser per session.

Playwright's Python API runs on asyncio and the tests on Trio, so the
browser lives in a thread of its own that runs its own asyncio loop, for the
whole test session (starting chromium once instead of once per test). A test
submits its scenario to that loop (``asyncio.run_coroutine_threadsafe``) and
waits for it in a Trio worker thread, so the test (and the web server it
serves in its own nursery) keeps running meanwhile. Each scenario gets a
fresh browser context, closed when it ends, so no cookie, cache or open page
passes from one test to the next. Playwright's own browser download is not
used: the Debian package's ``/usr/bin/chromium`` is.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest
import trio
from playwright.async_api import Browser, BrowserContext, Playwright, async_playwright

T = TypeVar("T")

CHROMIUM = "/usr/bin/chromium"


def require_chromium() -> None:
    if shutil.which(CHROMIUM) is None:
        pytest.fail(f"{CHROMIUM} missing: apt-get install chromium (see .ci/run)")


class Chromium:
    """A headless chromium on an asyncio loop in its own thread; see :meth:`started`."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._playwright: Playwright | None = None
        self._browser: Browser | None = None
        self._stop: asyncio.Event | None = None
        self._failed: BaseException | None = None

    @classmethod
    @contextlib.contextmanager
    def started(cls) -> Iterator[Chromium]:
        """Start the thread, its loop and chromium; on exit close all three,
        cancelling a scenario that a test left running."""
        require_chromium()
        chromium = cls()
        ready = threading.Event()
        thread = threading.Thread(target=chromium._thread, args=(ready,), name="playwright")
        thread.start()
        try:
            ready.wait()
            if chromium._failed is not None:
                raise chromium._failed
            yield chromium
        finally:
            if chromium._loop is not None and chromium._stop is not None:
                chromium._loop.call_soon_threadsafe(chromium._stop.set)
            thread.join()

    def _thread(self, ready: threading.Event) -> None:
        # The loop is made by asyncio.run in this thread: under trio-asyncio
        # (loaded by the tests' fixtures) asyncio's policy is trio-asyncio's,
        # whose loops belong to the thread that makes them.
        try:
            asyncio.run(self._serve(ready))
        finally:
            ready.set()  # also when the launch failed

    async def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            await self._launch()
        except BaseException as e:
            self._failed = e
            raise
        finally:
            ready.set()
        try:
            await self._stop.wait()
        finally:
            if self._browser is not None:
                await self._browser.close()
            if self._playwright is not None:
                await self._playwright.stop()

    async def _launch(self) -> Browser:
        if self._playwright is None:
            self._playwright = await async_playwright().start()
        self._browser = await self._playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox"]
        )
        return self._browser

    async def _in_context(self, scenario: Callable[[BrowserContext], Awaitable[T]]) -> T:
        browser = self._browser
        if browser is None or not browser.is_connected():
            browser = await self._launch()  # a crashed browser fails one test, not the rest
        context = await browser.new_context()
        try:
            return await scenario(context)
        finally:
            # Also the contexts the scenario opened itself (several users).
            for opened in browser.contexts:
                await opened.close()

    async def run(self, scenario: Callable[[BrowserContext], Awaitable[T]]) -> T:
        """Run ``scenario(context)`` in a fresh browser context; its result.

        ``context.browser`` opens more contexts, for scenarios of several
        users; every context is closed when the scenario ends. Cancelling
        the Trio caller cancels the scenario on the browser's loop.
        """
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(self._in_context(scenario), self._loop)
        try:
            return await trio.to_thread.run_sync(future.result, abandon_on_cancel=True)
        finally:
            future.cancel()  # a no-op once it is done
