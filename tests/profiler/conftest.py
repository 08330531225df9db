"""The profiler tests' fixtures: a real profile of the split pipeline, and a headless Chromium
(the browser tests skip only where none is installed)."""

from __future__ import annotations

import pytest

from tests.profiler.helpers import CHROMIUM_ARGS, Page, chromium, profile


@pytest.fixture(scope="session")
def split_profile():
    """A real profile through executor processes: 24 requests, 4 at a time."""
    return profile("process", 24)


@pytest.fixture(scope="session")
def thousand_profile():
    """A thousand requests of 24 to 39 tokens, 16 at a time, in one process."""
    return profile("inprocess", 1000, concurrency=16, tokens=lambda i: 24 + i % 16)


@pytest.fixture(scope="module")
def browser():
    # Module-scoped: while sync_playwright runs, its event loop is the main thread's running
    # loop, and any later test's asyncio.run() would fail.
    executable = chromium()
    if executable is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def open_page(browser):
    pages: list[Page] = []

    def open_(url: str) -> Page:
        pages.append(Page(browser, url))
        return pages[-1]

    yield open_
    for p in pages:
        p.page.close()
