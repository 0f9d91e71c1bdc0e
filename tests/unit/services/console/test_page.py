"""The console's page in a real browser (tests/browser.py: the system's Chromium driven by Playwright) against
a real `rollstream-console` over a run published on Redis. What is checked is what a user sees.

    python -m pytest tests/unit/services/console/test_page.py -q
"""

from __future__ import annotations

from tests.browser import chromium_page, expect
from tests.unit.services.console.conftest import TOKEN
from tests.unit.services.console.published_run import ANSWER, TESTS, TOOL_CALL


def test_the_page_lists_a_rollout_and_the_inspector_shows_its_tokens_tool_call_and_tests(console):
    rollouts = console.published.rollouts
    with chromium_page() as page:
        page.goto(console.url)
        expect(page.locator("#auth")).to_be_visible()
        expect(page.locator("#auth-why")).to_have_text("bearer token required")

        page.goto(f"{console.url}#token={TOKEN}")
        row = page.locator(f"#rollout-list tr[data-rollout='{rollouts['calculator']}']")
        expect(row).to_contain_text("reward 1.000")
        assert TOKEN not in page.url
        expect(page.locator("#run")).to_have_text(f"run {console.published.run}")
        expect(page.locator("#stream-table")).to_contain_text("trajectories")
        expect(page.locator("#dead-letters")).to_contain_text("unknown event type 'NoSuchEvent'")

        row.click()
        inspection = page.locator("#inspection")
        expect(inspection).to_contain_text("tool calculator")
        sampled = inspection.locator(".tok.lp-low")
        assert "".join(sampled.all_text_contents()) == ANSWER
        assert inspection.locator(".tok.ctx").count() > 0
        # the trainer saw each sampled token TRAINER_GAP likelier than vLLM: underlined in red, with both
        # logprobs in its title
        assert "".join(inspection.locator(".tok.gap-big").all_text_contents()) == TOOL_CALL + ANSWER
        assert "(trainer)" in inspection.locator(".tok.gap-big").first.get_attribute("title")
        expect(inspection).to_contain_text("trainer's logprobs at v0")
        expect(inspection).to_contain_text("policy v0 → v1 (weights synced mid-turn)")

        page.locator(f"#rollout-list tr[data-rollout='{rollouts['coding']}']").click()
        expect(inspection).to_contain_text("tool write_file")
        for test, outcome in TESTS.items():
            expect(inspection.locator("tr", has_text=test)).to_contain_text(outcome)
        expect(inspection.locator(".diff-del")).to_have_text("-def add(a, b): return a - b")
        expect(inspection.locator(".diff-add")).to_have_text("+def add(a, b): return a + b")
        expect(inspection).to_contain_text("test_sub FAILED")  # the sandbox's output
        expect(inspection).to_contain_text("--services sandbox-grader,reward")
