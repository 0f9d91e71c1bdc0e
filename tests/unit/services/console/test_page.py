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


def test_the_page_shows_each_roles_segments_versions_rewards_and_the_fleets_adapters(console):
    rollouts = console.published.rollouts
    with chromium_page() as page:
        page.goto(f"{console.url}#token={TOKEN}")
        # the server's adapters are its own, not servers of the fleet
        server = page.locator("#replicas tr", has_text=console.published.fleet_url)
        expect(server).to_contain_text("policy_version: 5, adapters: planner v3, solver v4")
        expect(page.locator("#replicas")).not_to_contain_text("planner@")
        expect(page.locator("#batches-waiting")).to_contain_text("latest policy v1 (planner v1, solver v0)")

        row = page.locator(f"#rollout-list tr[data-rollout='{rollouts['roles']}']")
        expect(row).to_contain_text("reward 0.500 (planner 1.000, solver 0.000), "
                                    "advantage planner 0.500, solver -0.500")
        row.click()
        inspection = page.locator("#inspection")
        expect(inspection).to_contain_text("roles planner, solver")
        heads = inspection.locator(".turn-head")
        expect(heads).to_have_count(4)
        for index, (segment, version) in enumerate([(0, "planner v3"), (0, "planner v4"), (1, "solver v1"),
                                                    (1, "solver v2")]):
            expect(heads.nth(index)).to_contain_text(f"segment {segment} · turn {index % 2} · {version} ·")
        expect(inspection.locator("tr", has_text="solver v1 solver v2")).to_contain_text("solver")
        expect(inspection).to_contain_text("rewards per role: planner 1, solver 0")
        expect(inspection).to_contain_text("advantages per role: planner 0.5, solver -0.5")

        # a rollout of the default role alone reads as one policy's; its batch trained into each role's
        # version
        page.locator(f"#rollout-list tr[data-rollout='{rollouts['calculator']}']").click()
        expect(inspection).to_contain_text("policy v0 → v1 (weights synced mid-turn)")
        expect(inspection).to_contain_text("trained into v1 (planner v1, solver v0)")
        expect(inspection).not_to_contain_text("roles planner")
