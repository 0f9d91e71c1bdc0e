"""A page in a real browser for the console's tests: the system's Chromium (Debian's `chromium`, which .ci/run
and `make setup` install) driven by Playwright. Without Chromium the test is skipped, which CI
(RS_TEST_REQUIRE_INFRA=1) turns into a failure.

    with chromium_page() as page:
        page.goto(url)
        expect(page.locator("#run")).to_have_text("run r1")
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

WAIT_MS = 30_000
"""How long an expectation waits for the page to show it (the page polls the API every few seconds)."""


@contextmanager
def chromium_page(**options) -> Iterator:
    """A new page of a headless Chromium (options: Playwright's new_page's, e.g. viewport); closed after."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium; .ci/run and make setup "
                    "install it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    sync_api.expect.set_options(timeout=WAIT_MS)
    with sync_api.sync_playwright() as playwright:
        # no sandbox of Chromium's own: the tests run as root, which Chromium's sandbox refuses
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield browser.new_page(**options)
        finally:
            browser.close()


def expect(target):
    """Playwright's expect (waiting up to WAIT_MS); imported here, once chromium_page found Playwright."""
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(target)
