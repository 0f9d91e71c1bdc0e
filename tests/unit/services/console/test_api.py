"""The console's JSON API, served by a real `rollstream-console` process, over a run published through the
Bus on the machine's Redis (published_run.py): who may call it, and what each route says of the run.

    python -m pytest tests/unit/services/console -q
"""

from __future__ import annotations

import time
import uuid

import pydantic
import pytest
from fastapi.testclient import TestClient

from rollstream.services.console.api import ConsoleState, build_app
from rollstream.services.console.inspector import read_run_file
from rollstream.services.console.watch import RunWatch
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import (
    BatchReady,
    PolicyUpdated,
    TrajectoryFinished,
    encode,
    make_envelope,
)
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.sections.console import ConsoleSettings
from tests.support import free_port
from tests.unit.services.console.conftest import TOKEN
from tests.unit.services.console.published_run import (
    AGENT_RUNNER,
    ANSWER,
    DIFF,
    FLEET_VERSIONS_HELD,
    FORKED_ANSWER,
    ROLE_ADVANTAGES,
    ROLE_REWARDS,
    SANDBOX_OUTPUT,
    TESTS,
    TRAINER_GAP,
)


def test_the_api_asks_for_the_token_and_the_page_holds_no_data(console):
    missing = console.get("/api/overview", token=None)
    assert missing.status_code == 401 and missing.json() == {"error": "bearer token required"}
    assert missing.headers["WWW-Authenticate"].startswith("Bearer")
    for path in ("/api/curves", "/api/rollouts", f"/api/rollouts/{console.published.rollouts['coding']}"):
        assert console.get(path, token=None).status_code == 401, path
    wrong = console.get("/api/rollouts", token="not-the-token-at-all")
    assert wrong.status_code == 403 and wrong.json() == {"error": "wrong token"}
    page = console.get("/", token=None)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert console.published.run not in page.text
    # nothing to fetch from elsewhere: no script, style sheet or image of its own, no absolute URL to call
    assert [word for word in ("src=", "<link", "@import", "url(") if word in page.text] == []
    assert 'fetch(path' in page.text and "fetch(\"http" not in page.text


def test_overview_shows_replicas_consumers_streams_throughput_and_dead_letters(console):
    overview = console.get("/api/overview").json()
    assert overview["run_id"] == console.published.run
    replicas = {row["service"]: row for row in overview["replicas"]}
    assert replicas["console"]["status"] == "ok" and replicas["console"]["uptime_s"] >= 0
    assert replicas["reward"]["status"] == "unreachable" and "ConnectError" in replicas["reward"]["reason"]
    streams = {row["stream"]: row for row in overview["streams"]}
    prompts = streams["prompts"]
    (runners,) = [g for g in prompts["groups"] if g["name"] == "agent-runner"]
    assert (runners["lag"], runners["pending"]) == (4, 1)
    assert [(m["name"], m["pending"]) for m in runners["members"]] == [(AGENT_RUNNER, 1)]
    assert runners["members"][0]["idle_ms"] >= 0
    trajectories = streams["trajectories"]
    # every entry was published within the last minute: the throughput's last bucket holds them all
    assert trajectories["last_minute"] == trajectories["length"] == sum(trajectories["per_minute"]) > 0
    dead = overview["dead"]
    assert dead["total"] == 1
    (letter,) = dead["latest"]
    assert (letter["stream"], letter["group"]) == ("grades", "reward")
    assert "unknown event type 'NoSuchEvent'" in letter["error"]


def test_the_fleet_view_gives_each_server_the_version_of_its_policy_and_of_each_adapter(console):
    """FLEET_VERSIONS holds a server's adapters under `<role>@<url>`: they are that server's, not servers."""
    replicas = console.get("/api/overview").json()["replicas"]
    (server,) = [row for row in replicas if row["service"] == "vllm"]
    assert server["replica"] == server["url"] == console.published.fleet_url
    assert server["facts"] == {"policy_version": FLEET_VERSIONS_HELD[None],
                               "adapter_versions": {"planner": FLEET_VERSIONS_HELD["planner"],
                                                    "solver": FLEET_VERSIONS_HELD["solver"]}}
    assert server["status"] == "unreachable"  # nothing listens there


def test_curves_give_reward_and_staleness_per_version_and_reward_per_minute(console):
    curves = console.get("/api/curves").json()
    (version,) = curves["versions"]
    assert (version["version"], version["batch_mean_reward"], version["loss"]) == (1, 1.0, 0.25)
    assert (version["staleness_mean"], version["staleness_max"], version["dropped_stale"]) == (0.5, 1.0, 2)
    assert version["role_versions"] == {"planner": 1, "solver": 0}
    (minute,) = curves["reward_per_minute"]
    assert minute["count"] == 4 and minute["mean"] == pytest.approx(0.5)
    assert curves["batches_waiting"] == []


def test_rollouts_list_the_latest_first_with_status_grade_and_reward(console):
    rollouts = console.published.rollouts
    listed = console.get("/api/rollouts").json()["rollouts"]
    assert [row["rollout_id"] for row in listed] == [rollouts[name] for name in
                                                     ("roles", "dropped", "session", "coding", "calculator")]
    by_id = {row["rollout_id"]: row for row in listed}
    calculator, coding = by_id[rollouts["calculator"]], by_id[rollouts["coding"]]
    assert calculator["reward"] == 1.0 and calculator["status"] == "completed"
    assert coding["grade"] == "failed (0)" and coding["advantage"] == -0.5
    assert by_id[rollouts["dropped"]]["dropped"] == "grading_failed"
    assert by_id[rollouts["dropped"]]["grade"] == "could not grade"
    assert by_id[rollouts["session"]]["session_id"] == "sess-42"
    two_roles = by_id[rollouts["roles"]]
    assert (two_roles["role_rewards"], two_roles["role_advantages"]) == (ROLE_REWARDS, ROLE_ADVANTAGES)
    assert calculator["role_rewards"] == calculator["role_advantages"] == {}
    assert len(console.get("/api/rollouts", limit=2).json()["rollouts"]) == 2


def test_bad_input_gets_a_clear_error(console):
    too_many = console.get("/api/rollouts", limit=10_000)
    assert too_many.status_code == 422 and too_many.json() == {"error": "limit: Input should be less than or "
                                                                        "equal to 500"}
    with pytest.raises(pydantic.ValidationError, match="base URL of its health API"):
        ConsoleSettings(health_urls={"reward": "reward:8080/healthz"})


def test_an_unknown_rollout_is_a_404_that_names_the_rollouts_there(console):
    reply = console.get("/api/rollouts/no-such-rollout")
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error.startswith(f"no rollout 'no-such-rollout' in run '{console.published.run}'")
    assert console.published.rollouts["calculator"] in error


def test_the_inspector_has_tokens_tools_versions_and_the_batch(console):
    doc = console.get(f"/api/rollouts/{console.published.rollouts['calculator']}").json()
    (attempt,) = doc["attempts"]
    first, second = attempt["turns"]
    sampled = [t for t in second["tokens"] if t["mask"] == 1]
    assert "".join(t["text"] for t in sampled) == ANSWER and {t["logprob"] for t in sampled} == {-2.5}
    assert second["synced_mid_turn"]
    assert {(t["policy_version"], t["policy_version_end"]) for t in sampled} == {(0, 1)}
    assert all(t["logprob"] is None for t in second["tokens"] if t["mask"] == 0)
    # the trainer's logprob of each sampled token, from the file it wrote beside the batch
    assert {t["trainer_logprob"] for t in sampled} == {-2.5 + TRAINER_GAP}
    assert second["trainer_policy_version"] == 0
    assert all(t["trainer_logprob"] is None for t in second["tokens"] if t["mask"] == 0)
    assert [(t["name"], t["arguments"], t["content"]) for t in first["tools"]] == [
        ("calculator", {"expression": "40+2"}, "42")]
    (batch,) = doc["batches"]
    assert batch["trained_in"] == [1] and [row["reward"] for row in batch["rows"]] == [1.0]
    assert doc["replay"][0].startswith(f"rollstream replay {console.published.run} --to ")
    assert "--services reward" in doc["replay"][0]


def test_the_inspector_shows_each_segments_role_and_each_turns_version_as_its_roles(console):
    doc = console.get(f"/api/rollouts/{console.published.rollouts['roles']}").json()
    # the planner's segment names no role: it is the run's default role's, by that role's name
    assert (doc["default_role"], doc["roles"], doc["roles_shown"]) == ("planner", ["planner", "solver"], True)
    (attempt,) = doc["attempts"]
    # ROLE_TURN_VERSIONS: the planner's turns at its v3 and v4, the solver's at its v1 and v2
    assert [(s["segment_index"], s["role"], s["turn_policy_versions"]) for s in attempt["segments"]] == [
        (0, "planner", [3, 4]), (1, "solver", [1, 2])]
    assert [(t["segment_index"], t["role"], t["policy_version"]) for t in attempt["turns"]] == [
        (0, "planner", 3), (0, "planner", 4), (1, "solver", 1), (1, "solver", 2)]
    (reward,) = doc["rewards"]
    assert (reward["role_rewards"], reward["role_advantages"]) == (ROLE_REWARDS, ROLE_ADVANTAGES)


def test_a_rollout_of_the_default_role_alone_does_not_show_roles(console):
    doc = console.get(f"/api/rollouts/{console.published.rollouts['calculator']}").json()
    assert (doc["roles"], doc["roles_shown"]) == (["planner"], False)
    (batch,) = doc["batches"]
    assert batch["policies"] == [{"version": 1, "role_versions": {"planner": 1, "solver": 0}}]
    assert [row["role"] for row in batch["rows"]] == ["planner"]


def test_the_inspector_has_a_coding_rollouts_diff_sandbox_output_and_tests(console):
    doc = console.get(f"/api/rollouts/{console.published.rollouts['coding']}").json()
    (attempt,) = doc["attempts"]
    assert attempt["artifact_files"]["diff"]["text"] == DIFF
    (grade,) = doc["grades"]
    assert grade["tests"] == TESTS and grade["log"]["text"] == SANDBOX_OUTPUT and not grade["passed"]
    assert "--services sandbox-grader,reward" in doc["replay"][0]
    assert doc["replay"][1].endswith(console.published.rollouts["coding"])


def test_the_inspector_shows_the_samples_a_gateway_session_became(console):
    doc = console.get(f"/api/rollouts/{console.published.rollouts['session']}").json()
    (attempt,) = doc["attempts"]
    first, forked = attempt["segments"]
    assert first["shared_prefix"] is None and forked["shared_prefix"]["segment_index"] == 0
    assert 0 < forked["shared_prefix"]["tokens"] < forked["tokens"]
    assert forked["response_text"] == FORKED_ANSWER and forked["metadata"]["gateway_session"] == "sess-42"
    assert {s["session_id"] for s in attempt["segments"]} == {"sess-42"}


def test_files_outside_the_runs_storage_are_not_shown(tmp_path):
    (tmp_path / "secret").write_text("not for the console")
    escaping = tmp_path / "runs" / "run1" / ".." / ".." / "secret"
    shown = read_run_file(str(tmp_path / "runs"), "run1", str(escaping))
    assert "outside the run's storage" in shown["error"] and "text" not in shown


def test_a_redis_that_does_not_answer_is_a_503_that_says_so():
    settings = Settings(run_id="nowhere", redis_url=f"redis://127.0.0.1:{free_port()}/0", fleet={"urls": []},
                        security={"http_token": TOKEN})
    bus = Bus.connect(settings.redis, settings.run_id, ride_out_outages=False)
    app = build_app(ConsoleState(settings=settings, bus=bus, watch=RunWatch(bus, "runs"), decoder=None))
    reply = TestClient(app).get("/api/rollouts", headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 503 and reply.json()["error"].startswith("Redis unreachable")


@pytest.fixture
def own_run(machine_redis_url, tmp_path):
    """A run of the test's own on the machine's Redis, and a client of a console showing it."""
    settings = Settings(run_id=f"test-console-{uuid.uuid4().hex[:8]}", redis_url=machine_redis_url,
                        storage_uri=str(tmp_path), fleet={"urls": []}, security={"http_token": TOKEN})
    bus = Bus.connect(settings.redis, settings.run_id, ride_out_outages=False)
    watch = RunWatch(bus, str(tmp_path))
    app = build_app(ConsoleState(settings=settings, bus=bus, watch=watch, decoder=None))
    try:
        yield bus, TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"})
    finally:
        bus.delete_run()


def test_curves_name_a_loss_gone_nan_and_infinite_figures(own_run):
    """A diverged step (loss NaN, an infinite staleness) is when the console is looked at: its curves name
    those values, where null would say that there was none."""
    bus, console = own_run
    bus.publish("batches", BatchReady(batch_id="b1", uri="/b1.parquet", sample_count=1, group_ids=["g"],
                                      min_policy_version=0, mean_reward=0.5))
    bus.publish("policy", PolicyUpdated(version=1, checkpoint_uri="/v1", batch_id="b1", servers=[],
                                        parity_max_abs_diff=0.0, loss=float("nan"), trained_samples=1,
                                        metrics={"samples/staleness_mean": float("inf"),
                                                 "samples/staleness_max": float("-inf")}))
    reply = console.get("/api/curves")
    assert reply.status_code == 200, reply.text
    (version,) = reply.json()["versions"]
    assert (version["version"], version["batch_mean_reward"]) == (1, 0.5)
    named = ("NaN", "Infinity", "-Infinity")
    assert (version["loss"], version["staleness_mean"], version["staleness_max"]) == named


def test_a_run_that_went_quiet_still_lists_its_last_rollouts(own_run):
    """Rollouts that finished longer ago than the throughput window (a run that is done, a page opened late)
    are listed: the first read goes back to at least the last TAIL_BACKLOG entries, however few there are."""
    bus, console = own_run
    finished = TrajectoryFinished(status="completed", segment_count=1, group_size=1, sample_index=0)
    an_hour_ago_ms = int(time.time() * 1000) - 3_600_000
    bus.redis.xadd(bus.keys.stream("trajectories"),
                   encode(make_envelope(finished, run_id=bus.keys.run_id, rollout_id="quiet-r0000000")),
                   id=f"{an_hour_ago_ms}-0")
    rollouts = console.get("/api/rollouts").json()["rollouts"]
    assert [row["rollout_id"] for row in rollouts] == ["quiet-r0000000"]
