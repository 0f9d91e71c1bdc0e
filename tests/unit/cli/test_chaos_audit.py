"""The chaos audit (cli/chaos/audit.py) on runs written event by event into a real Redis, with real batch
files: a segment in two rows is a duplicate, a row the trainer left out as invalid is never counted as
trained, drops beyond what the faults explain fail the audit, and so does a process exit no fault
brought about (the local run's supervisor records it, with the process's log tail); so do, in a run of
black-box agents, an agent process left running and a gateway session open past its end. Entries written
into a run from outside (poison) are left out of it, and a poisoned run's checks of its samples and batches
(cli/chaos/poison_report.py) are read from it.

The audit of a whole run under fault injection is tests/integration/test_chaos.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
import uuid

import pytest
import redis

from rollstream.cli.chaos.audit import (
    CONSUMER_GROUPS,
    BlackBoxAudit,
    RowLimits,
    audit_blackbox,
    audit_run,
    drop_bound,
)
from rollstream.cli.chaos.harness import ChaosPlan, plan_faults
from rollstream.cli.chaos.poison_report import admitted_check, batches_check, checks
from rollstream.cli.chaos.poison_report import audit as poison_audit
from rollstream.services.gateway.sessions import ROOT, Session, SessionSpec, TurnNode
from rollstream.shared.contract.batches import BatchRow, write_batch
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import (
    BatchReady,
    PolicyUpdated,
    PromptIssued,
    RolloutDropped,
    TrajectoryFinished,
)
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.runtime.config import BusSettings, Settings
from rollstream.shared.runtime.storage import Storage
from rollstream.shared.sandbox.host_uids import process_uids
from tests.support import supervised_run
from tests.unit.services.gateway.stores import session_store

LIMITS = RowLimits(vocab_size=32, max_positions=64)
MAX_STALENESS = 1


@pytest.fixture
def bus(machine_redis_url):
    client = redis.Redis.from_url(machine_redis_url)
    bus = Bus(client, f"test-{uuid.uuid4().hex[:10]}", BusSettings())
    yield bus
    bus.delete_run()
    client.close()


def ids(rollout: str) -> dict[str, str]:
    return {"rollout_id": rollout, "trajectory_id": rollout, "session_id": rollout,
            "group_id": f"g-{rollout}"}


def admit(bus: Bus, rollout: str, segments: int = 1) -> None:
    """A rollout admitted and finished with `segments` segments."""
    prompt = PromptIssued(sample_index=0, group_size=1, policy_version=0, label="2",
                          messages=[{"role": "user", "content": "1+1"}])
    finished = TrajectoryFinished(status="completed", attempt="a", segment_count=segments, group_size=1,
                                  sample_index=0, response_text="2", label="2")
    bus.publish("prompts", prompt, **ids(rollout))
    bus.publish("trajectories", finished, **ids(rollout))


def row(rollout: str, segment: int = 0, tokens: tuple[int, ...] = (1, 2, 3)) -> BatchRow:
    return BatchRow(sample_index=0, trajectory_id=rollout, rollout_id=rollout, group_id=f"g-{rollout}",
                    session_id=rollout, segment_index=segment, tokens=list(tokens), response_length=1,
                    loss_mask=[0] * (len(tokens) - 1) + [1],
                    rollout_logprobs=[0.0] * (len(tokens) - 1) + [-0.5], turn_policy_versions=[0],
                    status="completed", reward=1.0, advantage=0.5)


def train(bus: Bus, storage_uri: str, version: int, rows: list[BatchRow], trained: int,
          dropped: dict[str, int] | None = None, role_versions: dict[str, int] | None = None) -> None:
    """A batch of `rows`, and the trainer's PolicyUpdated for it saying `trained` rows were trained."""
    batch_id = f"b{version}"
    uri = write_batch(Storage(storage_uri), bus.keys.run_id, batch_id, rows)
    bus.publish("batches", BatchReady(batch_id=batch_id, uri=uri, sample_count=len(rows),
                                      min_policy_version=0, group_ids=sorted({r.group_id for r in rows}),
                                      mean_reward=1.0))
    bus.publish("policy", PolicyUpdated(version=version, checkpoint_uri=f"/ckpt/v{version}",
                                        batch_id=batch_id, servers=[], parity_max_abs_diff=0.0, loss=0.0,
                                        trained_samples=trained, dropped=dropped or {},
                                        role_versions=role_versions or {}))


def audit(bus: Bus, storage_uri: str, leave_out: set[tuple[str, str]] = frozenset(), roles=None):
    """The audit once every consumer group has read everything (nothing is left pending)."""
    for stream, group in CONSUMER_GROUPS:
        bus.redis.xgroup_create(bus.keys.stream(stream), group, id="$", mkstream=True)
    return audit_run(bus, storage_uri, MAX_STALENESS, limits=LIMITS, leave_out=leave_out, roles=roles)


def test_a_segment_in_two_rows_of_one_batch_or_of_two_batches_is_a_duplicate_and_fan_out_is_not(bus,
                                                                                                 tmp_path):
    runs = str(tmp_path)
    for rollout, segments in (("fanned", 2), ("twice-in-one", 1), ("twice-in-two", 1)):
        admit(bus, rollout, segments)
    train(bus, runs, 1, [row("fanned", 0), row("fanned", 1), row("twice-in-one"), row("twice-in-one"),
                         row("twice-in-two")], trained=5)
    train(bus, runs, 2, [row("twice-in-two")], trained=1)

    report = audit(bus, runs)
    assert sorted(report.duplicated) == ["twice-in-one segment 0", "twice-in-two segment 0"]
    assert report.trained == 1  # the rollout with fan-out: two segments, one row each
    assert any(p.startswith("duplicated: 2") for p in report.problems())


def test_a_rollout_missing_one_of_its_segments_is_lost(bus, tmp_path):
    admit(bus, "fanned", segments=3)
    train(bus, str(tmp_path), 1, [row("fanned", 0), row("fanned", 2)], trained=2)

    report = audit(bus, str(tmp_path))
    assert report.lost == ["fanned (segments [0, 2] batched, its attempts had [3])"] and report.trained == 0


def test_rows_the_trainer_left_out_as_invalid_are_counted_apart_and_never_as_trained(bus, tmp_path):
    admit(bus, "good")
    admit(bus, "out-of-vocabulary")
    rows = [row("good"), row("out-of-vocabulary", tokens=(1, 2, LIMITS.vocab_size + 5))]
    train(bus, str(tmp_path), 1, rows, trained=1, dropped={"invalid": 1})

    report = audit(bus, str(tmp_path))
    assert (report.trained, report.left_out_invalid, report.dropped) == (1, 1, {})
    assert report.rows == {"trained": 1, "stale": 0, "invalid": 1}
    assert report.problems() == []


def test_a_trainer_that_counts_an_invalid_row_as_trained_fails_the_audit(bus, tmp_path):
    admit(bus, "good")
    admit(bus, "too-long")
    # 90 tokens, the model has 64 positions
    rows = [row("good"), row("too-long", tokens=tuple(range(1, 31)) * 3)]
    train(bus, str(tmp_path), 1, rows, trained=2)

    report = audit(bus, str(tmp_path))
    assert report.trained == 1 and report.left_out_invalid == 1
    assert report.trainer_disagrees == ["b1 (rows: {'trained': 1, 'invalid': 1}, PolicyUpdated: "
                                        "{'trained': 2, 'stale': 0, 'invalid': 0})"]
    assert any(p.startswith("trainer disagrees") for p in report.problems())


def test_entries_written_into_the_run_from_outside_are_left_out_of_what_became_of_its_own(bus, tmp_path):
    """Poison: a prompt the dispatcher never admitted, a policy version far ahead of the run."""
    runs = str(tmp_path)
    admit(bus, "own")
    train(bus, runs, 1, [row("own")], trained=1)
    prompt = PromptIssued(sample_index=0, group_size=1, policy_version=0, label="2",
                          messages=[{"role": "user", "content": "1+1"}])
    forged = {("prompts", bus.publish("prompts", prompt, **ids("forged"))),
              ("policy", bus.publish("policy", PolicyUpdated(version=10**6, checkpoint_uri="/ckpt/forged",
                                                             batch_id="b?", servers=[],
                                                             parity_max_abs_diff=0.0, loss=0.0,
                                                             trained_samples=1)))}

    report = audit(bus, runs, leave_out=forged)
    assert (report.admitted, report.trained, report.problems()) == (1, 1, [])
    assert report.events["prompts"] == 2  # still entries added, and in the archive's check
    unfiltered = audit_run(bus, runs, MAX_STALENESS, limits=LIMITS)
    assert unfiltered.lost == ["forged"] and unfiltered.versions_missing[:2] == [2, 3]


def test_a_poisoned_runs_samples_are_checked_by_the_runs_audit_and_none_may_be_dropped_by_the_reward_service(
        bus, tmp_path):
    runs = str(tmp_path)
    admit(bus, "fresh")
    admit(bus, "stale")
    train(bus, runs, 1, [row("fresh")], trained=1)
    train(bus, runs, 3, [row("stale")], trained=0, dropped={"stale": 1})  # too old for version 3: left out
    report = audit(bus, runs)
    assert report.dropped == {"stale": 1}
    assert admitted_check(report)[1:] == (True, "2/2 in one batch, 0 lost, 0 in several rows")
    assert batches_check(report) == ("every batch of the run trained once", True, "2/2 trained")

    admit(bus, "dropped")
    bus.publish("rewards", RolloutDropped(reason="no grade", cause="grade_timeout"), **ids("dropped"))
    bus.publish("batches", BatchReady(batch_id="b-untrained", uri=f"{runs}/b-untrained.parquet",
                                      sample_count=1, min_policy_version=0, group_ids=["g"], mean_reward=1.0))
    report = audit_run(bus, runs, MAX_STALENESS, limits=LIMITS)
    assert admitted_check(report)[1:] == (
        False, "2/3 in one batch, 0 lost, 1 dropped by the reward service (grade_timeout 1), "
               "0 in several rows")
    assert batches_check(report)[1:] == (False, "2/3 trained")


def chaos_settings(**overrides) -> Settings:
    return Settings(data={"samples_per_prompt": 4}, rollout={"concurrency": 8},
                    train={"batch_size": 8, "max_staleness": MAX_STALENESS, **overrides})


def test_the_drop_bound_follows_the_faults_injected():
    settings = chaos_settings()
    replicas = {"agent-runner": 2, "sandbox-grader": 1}
    assert drop_bound([], settings, replicas) == {"grading_failed + grade_timeout": 0, "stale": 0,
                                                  "dead_lettered": 0, "batch_dead_lettered": 0, "filtered": 0,
                                                  "frozen": None}
    faults = [("horse", "sandbox work-horse"), ("crash", "sandbox-grader"), ("redis", "redis"),
              ("crash", "reward"), ("crash", "dispatcher"), ("pause", "agent-runner")]
    bound = drop_bound(faults, settings, replicas)
    assert bound["grading_failed + grade_timeout"] == 3
    # the paused replica's rollouts, and every replica's during Redis's
    assert bound["stale"] == 8 * 4 + 2 * 8 * 4
    assert bound["dead_lettered"] == 0  # no consumer suffered max_deliveries (5) faults
    assert drop_bound([], chaos_settings(filter_zero_variance=True), replicas)["filtered"] is None


def test_a_gateway_crash_holds_back_every_agent_runners_episodes_and_may_fail_a_delivery_of_each():
    settings = chaos_settings()  # bus.max_deliveries 5, rollout.concurrency 8
    replicas = {"agent-runner": 2, "gateway": 2}
    bound = drop_bound([("crash", "gateway")], settings, replicas)
    assert bound["stale"] == 2 * 8 * 4 and bound["dead_lettered"] == 0  # 2 faults of the agent-runners' group
    # three gateway crashes: 6 faults of the agent-runners' group, each holding 8 prompts, 5 deliveries each
    assert drop_bound([("crash", "gateway")] * 3, settings, replicas)["dead_lettered"] == 6 * 8 // 5


def test_the_planned_faults_can_be_kept_to_some_services():
    processes = {"gateway-1": "gateway", "gateway-2": "gateway", "agent-runner-1": "agent-runner",
                 "agent-runner-2": "agent-runner", "trainer": "trainer", "sandbox-grader": "sandbox-grader"}
    plan = ChaosPlan(seed=3, kills_per_service=2, services=("gateway", "agent-runner"), redis_restarts=0,
                     vllm_restarts=0, pauses=0)
    replicas = ["agent-runner-1", "agent-runner-2", "gateway-1", "gateway-2"]
    assert sorted(plan_faults(plan, processes)) == sorted([("crash", name) for name in replicas] * 2)
    everything = plan_faults(ChaosPlan(seed=3, redis_restarts=0, vllm_restarts=0, pauses=0), processes)
    assert sorted(everything) == sorted([*(("crash", name) for name in processes),
                                         ("horse", "sandbox work-horse")])


def blackbox_settings(tmp_path) -> Settings:
    return Settings(storage_uri=str(tmp_path), agent={"default": "command"}, gateway={"finish_grace_s": 30})


def test_open_gateway_sessions_must_end_by_their_deadline_plus_the_grace(bus, redis_url, tmp_path):
    settings = blackbox_settings(tmp_path)

    async def sessions() -> Session:
        async with session_store(bus, redis_url, ttl_s=settings.gateway.session_ttl_s,
                                 finish_grace_s=settings.gateway.finish_grace_s) as store:
            async def create(session_id: str, budget_s: float | None = 60.0):
                rollout = f"r-{session_id}"
                spec = SessionSpec(rollout_id=rollout, group_id="g", trajectory_id=rollout,
                                   session_id=session_id, time_budget_s=budget_s)
                return (await store.create(spec))[0]

            await create("ending")
            await create("finished")
            node = TurnNode(ROOT, [1], [2], [-0.1], 0, 0, "stop", "http://v", "", 0.0)
            assert await store.add_turn("finished", "a", node)
            assert store.finish("finished", lambda pipe, samples: None)
            await create("without-budget", budget_s=None)
            return await create("never-expiring")

    never_expiring = asyncio.run(sessions())
    bus.redis.persist(bus.keys.state("gateway", "session", "never-expiring"))

    report = audit_blackbox(bus, settings, set())
    assert report.sessions_open == 3 and report.agents_left == []
    assert report.sessions_past_end == [
        "without-budget (rollout r-without-budget): it has no end (time budget: None)",
        f"never-expiring (rollout r-never-expiring): its keys never expire (its end is "
        f"{never_expiring.ends_at:.3f})"]


@pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes run as uids of their agent-runner only under root")
def test_a_process_of_a_dead_agent_runners_sandbox_uid_is_an_agent_left_running(bus, tmp_path):
    dead = subprocess.Popen(["true"])  # an agent-runner that was killed
    dead.wait()
    leftover = subprocess.Popen(["sleep", "60"], user=process_uids(dead.pid)[3])  # its sandbox's, slot 3
    try:
        report = audit_blackbox(bus, blackbox_settings(tmp_path), {dead.pid, os.getpid()})
        assert report.agents_left == [f"pid {leftover.pid} (a sandbox uid of agent-runner pid {dead.pid})"]
    finally:
        leftover.kill()
        leftover.wait()
    assert audit_blackbox(bus, blackbox_settings(tmp_path), {dead.pid}).agents_left == []
    report = audit(bus, str(tmp_path))
    report.blackbox = BlackBoxAudit(agents_left=["pid 7 (a sandbox uid of agent-runner pid 3)"],
                                    sessions_past_end=["s (rollout r): it has no end (time budget: None)"])
    assert report.problems() == [
        "black-box agents left running: 1 (pid 7 (a sandbox uid of agent-runner pid 3))",
        "gateway sessions open past their end: 1 (s (rollout r): it has no end (time budget: None))"]


def test_drops_beyond_what_the_faults_explain_fail_the_audit(bus, tmp_path):
    """A grader that lost every grade: one work-horse kill explains one grade_timeout, not three."""
    for rollout in ("r1", "r2", "r3"):
        admit(bus, rollout)
        bus.publish("rewards", RolloutDropped(reason="no grade", cause="grade_timeout"), **ids(rollout))
    report = audit(bus, str(tmp_path))
    assert report.dropped == {"grade_timeout": 3} and report.problems() == []
    assert report.drop_reasons == {"grade_timeout": ["r1: no grade", "r2: no grade", "r3: no grade"]}

    report.check_drops(drop_bound([("horse", "sandbox work-horse")], chaos_settings(), {}))
    assert report.problems() == ["more drops than the faults explain: grading_failed + grade_timeout: "
                                 "3 dropped, the faults explain at most 1 (r1: no grade; r2: no grade; "
                                 "r3: no grade)"]
    report.check_drops(drop_bound([("horse", "sandbox work-horse")] * 3, chaos_settings(), {}))
    assert report.problems() == []


@pytest.fixture
def supervised(tmp_path, monkeypatch):
    """A local run's supervisor over two real processes: a reward that crashes with a message, a trainer
    that sleeps."""
    commands = {"reward": [sys.executable, "-c",
                           "print('boom: poison entry', flush=True); raise SystemExit(3)"],
                "trainer": [sys.executable, "-c", "import time; time.sleep(60)"]}
    with supervised_run(tmp_path, monkeypatch, commands, "audit") as run:
        yield run


def test_an_exit_the_harness_did_not_bring_about_fails_both_audits_with_the_log_tail(supervised, bus,
                                                                                    tmp_path):
    supervised.crash("trainer")  # fault injection: on record, but no failure
    supervised.processes["reward"].wait()
    supervised.check_alive()  # the end's check: sees the reward's exit, whenever it came
    assert sorted((e.process, e.injected) for e in supervised.exits) == [("reward", False), ("trainer", True)]

    report = audit(bus, str(tmp_path))
    report.unexpected_exits = supervised.unexpected_exits()
    (problem,) = report.problems()
    assert problem.startswith("a process exited that the harness did not stop: "
                              "reward exited on its own with code 3")
    assert "boom: poison entry" in problem

    poisoned = poison_audit(bus, str(tmp_path), [], seed=0, rate=1.0, target_version=0, health={},
                            unhealthy_moments=[], dispatcher_version_seen=0, max_staleness=MAX_STALENESS,
                            limits=LIMITS)
    poisoned.unexpected_exits = supervised.unexpected_exits()
    failed = [(name, figures) for name, passed, figures in checks(poisoned) if not passed]
    assert ("no process exited, not even one the supervisor restarted (the drain and the end included)",
            f"reward code 3 at {supervised.unexpected_exits()[0].at_s:.0f}s") in failed


def test_an_exit_the_supervisor_restarted_stays_on_record(supervised):
    supervised.processes["reward"].wait()
    deadline = time.monotonic() + 20
    while supervised.restarts.get("reward", 0) < 1:
        supervised.check_alive()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [e.process for e in supervised.unexpected_exits()] == ["reward"]



def test_a_two_role_run_is_audited_per_role_each_row_against_its_own_roles_version(bus, tmp_path):
    """The planner's rows are judged stale by the planner's versions, the solver's by the solver's; a frozen
    role's rows are never trained, and a rollout of only such rows is dropped as frozen; every fate is
    counted per role."""
    roles = RunRoles.of(Settings(roles={"names": {"planner": {}, "solver": {}, "critic": {"trained": False}}},
                                 train={"lora_rank": 8}))
    runs = str(tmp_path)
    for rollout in ("r1", "r2", "r3", "critic-only"):
        admit(bus, rollout, segments=2)

    def role_row(rollout: str, segment: int, role: str | None, version: int) -> BatchRow:
        return dataclasses.replace(row(rollout, segment), role=role, turn_policy_versions=[version])

    # v1 and v2 train the planner alone (None: the default role, the planner): planner at 2, solver at 0
    train(bus, runs, 1, [role_row("r1", 0, None, 0), role_row("r1", 1, "critic", 0)], trained=1,
          dropped={"frozen": 1}, role_versions={"planner": 1, "solver": 0})
    train(bus, runs, 2, [role_row("critic-only", 0, "critic", 0), role_row("critic-only", 1, "critic", 0)],
          trained=0, dropped={"frozen": 2}, role_versions={"planner": 1, "solver": 0})
    train(bus, runs, 3, [role_row("r2", 0, "planner", 1), role_row("r2", 1, "solver", 0)], trained=2,
          role_versions={"planner": 2, "solver": 1})
    # at planner v2, a planner row sampled at v0 is two versions old (eta 1): stale; the solver's row of the
    # same turn version is trained, its role being at v1
    train(bus, runs, 4, [role_row("r3", 0, "planner", 0), role_row("r3", 1, "solver", 0)], trained=1,
          dropped={"stale": 1}, role_versions={"planner": 2, "solver": 2})

    report = audit(bus, runs, roles=roles)
    assert report.problems() == [] and report.trainer_disagrees == []
    assert (report.trained, report.dropped) == (2, {"frozen": 1, "stale": 1})
    assert report.rows == {"trained": 4, "stale": 1, "invalid": 0, "frozen": 3}
    assert report.rows_by_role == {"critic": {"frozen": 3}, "planner": {"trained": 2, "stale": 1},
                                   "solver": {"trained": 2}}
    # read as a run of one role, the same rows would not add up: the audit needs the run's roles
    assert audit_run(bus, runs, MAX_STALENESS, limits=LIMITS).trainer_disagrees
