"""The console's page in a real browser: the system's Chromium (Debian's `chromium`, which .ci/run and
`make setup` install), driven by Playwright, against a real `rollstream-console` over a run published on
Redis. What is checked is what a user sees.

    python -m pytest tests/unit/services/console/test_page.py -q
"""

from __future__ import annotations

import shutil

import pytest

from tests.unit.services.console.conftest import TOKEN
from tests.unit.services.console.published_run import ANSWER, TESTS

WAIT_MS = 30_000


def test_the_page_lists_a_rollout_and_the_inspector_shows_its_tokens_tool_call_and_tests(console):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium; .ci/run and make setup "
                    "install it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    rollouts = console.published.rollouts
    with sync_api.sync_playwright() as playwright:
        # no sandbox of Chromium's own: the tests run as root, which Chromium's sandbox refuses
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(console.url)
            sync_api.expect(page.locator("#auth")).to_be_visible(timeout=WAIT_MS)
            sync_api.expect(page.locator("#auth-why")).to_have_text("bearer token required")

            page.goto(f"{console.url}#token={TOKEN}")
            row = page.locator(f"#rollout-list tr[data-rollout='{rollouts['calculator']}']")
            sync_api.expect(row).to_contain_text("reward 1.000", timeout=WAIT_MS)
            assert TOKEN not in page.url
            sync_api.expect(page.locator("#run")).to_have_text(f"run {console.published.run}")
            sync_api.expect(page.locator("#stream-table")).to_contain_text("trajectories")
            sync_api.expect(page.locator("#dead-letters")).to_contain_text("unknown event type 'NoSuchEvent'")

            row.click()
            inspection = page.locator("#inspection")
            sync_api.expect(inspection).to_contain_text("tool calculator", timeout=WAIT_MS)
            sampled = inspection.locator(".tok.lp-low")
            assert "".join(sampled.all_text_contents()) == ANSWER
            assert inspection.locator(".tok.ctx").count() > 0
            sync_api.expect(inspection).to_contain_text("policy v0 → v1 (weights synced mid-turn)")

            page.locator(f"#rollout-list tr[data-rollout='{rollouts['coding']}']").click()
            sync_api.expect(inspection).to_contain_text("tool write_file", timeout=WAIT_MS)
            for test, outcome in TESTS.items():
                sync_api.expect(inspection.locator("tr", has_text=test)).to_contain_text(outcome)
            sync_api.expect(inspection.locator(".diff-del")).to_have_text("-def add(a, b): return a - b")
            sync_api.expect(inspection.locator(".diff-add")).to_have_text("+def add(a, b): return a + b")
            sync_api.expect(inspection).to_contain_text("test_sub FAILED")  # the sandbox's output
            sync_api.expect(inspection).to_contain_text("--services sandbox-grader,reward")
        finally:
            browser.close()
