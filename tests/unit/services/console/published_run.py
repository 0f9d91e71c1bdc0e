"""A small run as the services publish it, for the console's tests: every event goes through the Bus onto a
real Redis (rollouts through shared/contract/rollouts.py's publish_rollout, as the agent-runner and the
gateway publish theirs), its files go to a real storage folder.

    calculator  a tool call, then the answer in a turn the weights were synced in; graded by rule, rewarded,
                in a Parquet batch that policy version 1 was trained on
    coding      a write_file tool call, the episode's diff stored as its artifact, graded in a sandbox: one
                test passed, one failed, the sandbox's output stored as the grade's log
    session     a gateway session that became two samples: the second forks from the first's prompt
    dropped     a rollout the sandbox could not grade, dropped from its group
    roles       a rollout of two roles: a planner segment (naming no role: the run's default, planner) and a
                solver segment, each with turns at versions of its own role, rewarded per role
    and an agent-runner consumer holding a prompt, an entry of `grades` that does not decode, dead-lettered
    by the reward group, and the fleet's versions: one server holding the whole policy and an adapter of
    each role.

The run has two roles (ROLES, trained as LoRA adapters); policy version 1 trained the planner only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollstream.shared.contract.batches import (
    BatchRow,
    TrainerLogprobs,
    write_batch,
    write_trainer_logprobs,
)
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import (
    BatchReady,
    GradeReported,
    GradingFailed,
    PolicyUpdated,
    PromptIssued,
    RewardAssigned,
    RolloutDropped,
    SampleGrading,
    TrajectoryFinished,
    TrajectorySegment,
    TrajectoryStarted,
    TrajectoryTool,
    TrajectoryTurn,
)
from rollstream.shared.contract.roles import version_field
from rollstream.shared.contract.rollouts import RolloutFinish, Segment, publish_rollout
from rollstream.shared.contract.run_facts import FLEET_VERSIONS
from rollstream.shared.runtime.storage import Storage

SERVER = "http://127.0.0.1:8000"
QUESTION = "What is 40+2?"
TRAINER_GAP = 0.75
TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "40+2"}}</tool_call>'
OBSERVATION = ("<|im_end|>\n<|im_start|>tool\n<tool_response>42</tool_response><|im_end|>\n"
               "<|im_start|>assistant\n")
ANSWER = "The answer is 42."
DIFF = ("--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n"
        "-def add(a, b): return a - b\n+def add(a, b): return a + b\n")
SANDBOX_OUTPUT = "test_add PASSED\ntest_sub FAILED: assert add(1, -1) == 2\n"
TESTS = {"tests/test_calc.py::test_add": "passed", "tests/test_calc.py::test_sub": "failed"}
FORKED_ANSWER = "Forty-two."
AGENT_RUNNER = "agent-runner-host-4242"
ROLES = {"planner": {}, "solver": {}}
"""The run's roles (roles.names); the first, planner, is its default."""
ROLE_TURN_VERSIONS = {"planner": (3, 4), "solver": (1, 2)}
"""Each role's versions of its segment's two turns in the `roles` rollout."""
ROLE_REWARDS = {"planner": 1.0, "solver": 0.0}
ROLE_ADVANTAGES = {"planner": 0.5, "solver": -0.5}
FLEET_VERSIONS_HELD = {None: 5, "planner": 3, "solver": 4}
"""The fleet's one server: the whole policy's version (None) and each adapter's."""


@dataclass
class PublishedRun:
    run: str
    storage: str
    rollouts: dict[str, str]
    """calculator, coding, session, dropped, roles -> rollout id."""
    batch_id: str
    fleet_url: str


def _turn(number: int, offset: int, appended: list[int], response: list[int], logprob: float,
          versions: tuple[int, int] = (0, 0)) -> TrajectoryTurn:
    return TrajectoryTurn(turn=number, offset=offset, appended_ids=appended, response_ids=response,
                          logprobs=[logprob] * len(response), policy_version=versions[0],
                          policy_version_end=versions[1], finish_reason="stop", server_url=SERVER)


def _segment(turns: list[TrajectoryTurn], tools: list[TrajectoryTool], text: str, **metadata) -> Segment:
    tokens, mask, logprobs = [], [], []
    for turn in turns:
        tokens += turn.appended_ids + turn.response_ids
        mask += [0] * len(turn.appended_ids) + [1] * len(turn.response_ids)
        logprobs += [0.0] * len(turn.appended_ids) + turn.logprobs
    return Segment(tokens=tokens, prompt_length=len(turns[0].appended_ids), loss_mask=mask,
                   rollout_logprobs=logprobs, turn_policy_versions=[turn.policy_version for turn in turns],
                   status="completed", response_text=text, turns=turns, tools=tools, metadata=metadata)


class RunBuilder:
    def __init__(self, bus: Bus, storage: str, encode) -> None:
        self.bus, self.storage, self.encode = bus, Storage(storage), encode
        self.run = bus.keys.run_id
        self.prompt_ids = encode(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")

    def ids(self, rollout: str, group: str, session: str | None = None) -> dict[str, str]:
        return {"rollout_id": rollout, "group_id": group, "trajectory_id": rollout,
                "session_id": session or rollout}

    def publish(self, ids: dict[str, str], grading: SampleGrading, segments: list[Segment],
                finish: RolloutFinish, **metadata) -> None:
        prompt = PromptIssued(sample_index=grading.sample_index, group_size=grading.group_size,
                              messages=[{"role": "user", "content": QUESTION}], label=grading.label,
                              policy_version=0)
        self.bus.publish("prompts", prompt, **ids, event_id=f"{ids['rollout_id']}:prompt")
        pipe = self.bus.redis.pipeline(transaction=True)
        publish_rollout(self.bus, pipe, ids, grading, segments, finish, metadata=metadata, server_url=SERVER)
        pipe.execute()

    def calculator(self, rollout: str, group: str) -> Segment:
        call, answer = self.encode(TOOL_CALL), self.encode(ANSWER)
        observation = self.encode(OBSERVATION)
        answer_at = len(self.prompt_ids) + len(call) + len(observation)
        turns = [_turn(0, len(self.prompt_ids), self.prompt_ids, call, -0.05),
                 _turn(1, answer_at, observation, answer, -2.5, (0, 1))]
        tool = TrajectoryTool(turn=0, call_id="call_0_0", name="calculator", arguments={"expression": "40+2"},
                              ok=True, content="42")
        segment = _segment(turns, [tool], ANSWER)
        self.publish(self.ids(rollout, group), SampleGrading(sample_index=0, group_size=1, label="42"),
                     [segment], RolloutFinish(status="completed", response_text=ANSWER))
        self.reward(rollout, group, 1.0, 0.0)
        return segment

    def coding(self, rollout: str, group: str) -> None:
        call = self.encode('<tool_call>{"name": "write_file", "arguments": {"path": "calc.py"}}</tool_call>')
        tool = TrajectoryTool(turn=0, call_id="call_0_0", name="write_file", arguments={"path": "calc.py"},
                              ok=True, content="wrote calc.py")
        diff = self.storage.write_bytes(DIFF.encode(), self.run, "artifacts", f"{rollout}.diff")
        grading = SampleGrading(sample_index=1, group_size=3, sandbox_check="pytest -q")
        segment = _segment([_turn(0, len(self.prompt_ids), self.prompt_ids, call, -0.3)], [tool], "done")
        self.publish(self.ids(rollout, group), grading, [segment],
                     RolloutFinish(status="completed", response_text="done", artifacts={"diff": diff}))
        log = self.storage.write_bytes(SANDBOX_OUTPUT.encode(), self.run, "sandbox-logs", f"{rollout}.log")
        grade = GradeReported(score=0.0, passed=False, reason="1 of 2 tests failed", duration_s=1.5,
                              log_uri=log, tests=TESTS)
        self.bus.publish("grades", grade, event_id=f"{rollout}:grade", **self.ids(rollout, group))
        self.reward(rollout, group, 0.0, -0.5)

    def session(self, rollout: str, group: str) -> None:
        first, forked = self.encode(ANSWER), self.encode(FORKED_ANSWER)
        start = len(self.prompt_ids)
        segments = [_segment([_turn(0, start, self.prompt_ids, first, -0.2)], [], ANSWER),
                    _segment([_turn(0, start, self.prompt_ids, forked, -1.0)], [], FORKED_ANSWER)]
        self.publish(self.ids(rollout, group, session="sess-42"), SampleGrading(sample_index=2, group_size=3),
                     segments, RolloutFinish(status="completed", response_text=FORKED_ANSWER, reward=0.5),
                     gateway_session="sess-42", conversations=2)
        self.reward(rollout, group, 0.5, 0.5)

    def dropped(self, rollout: str, group: str) -> None:
        call = self.encode("ls")
        grading = SampleGrading(sample_index=3, group_size=3, sandbox_check="pytest -q")
        self.publish(self.ids(rollout, group), grading,
                     [_segment([_turn(0, len(self.prompt_ids), self.prompt_ids, call, -0.4)], [], "ls")],
                     RolloutFinish(status="completed", response_text="ls"))
        ids = self.ids(rollout, group)
        self.bus.publish("grades", GradingFailed(reason="cannot be graded: no sandbox", attempts=3), **ids)
        self.bus.publish("rewards", RolloutDropped(reason="grading failed", cause="grading_failed"), **ids)

    def roles(self, rollout: str, group: str) -> None:
        """A planner segment, then a solver segment, each turn at its role's version. The planner's names no
        role: it is the run's default role's."""
        ids, answer = self.ids(rollout, group), self.encode(ANSWER)
        prompt = PromptIssued(sample_index=0, group_size=1, messages=[{"role": "user", "content": QUESTION}],
                              label="42", policy_version=0)
        self.bus.publish("prompts", prompt, **ids, event_id=f"{rollout}:prompt")
        prefix = f"{rollout}:a0"
        self.bus.publish("trajectories", TrajectoryStarted(sample_index=0, server_url=SERVER), **ids,
                         event_id=f"{prefix}:started")
        for index, role in enumerate(ROLE_TURN_VERSIONS):
            turns = [_turn(number, len(self.prompt_ids), self.prompt_ids, answer, -0.2, (version, version))
                     .model_copy(update={"segment_index": index})
                     for number, version in enumerate(ROLE_TURN_VERSIONS[role])]
            for turn in turns:
                self.bus.publish("trajectories", turn, **ids, event_id=f"{prefix}:turn:{index}:{turn.turn}")
            segment = _segment(turns, [], ANSWER)
            self.bus.publish("trajectories", TrajectorySegment(
                segment_index=index, attempt="a0", tokens=segment.tokens,
                response_length=segment.response_length, loss_mask=segment.loss_mask,
                rollout_logprobs=segment.rollout_logprobs, turn_policy_versions=segment.turn_policy_versions,
                status="completed", response_text=ANSWER, sample_index=0, group_size=1,
                role=None if index == 0 else role), **ids, event_id=f"{prefix}:segment:{index}")
        finished = TrajectoryFinished(status="completed", attempt="a0", segment_count=2, group_size=1,
                                      sample_index=0, response_text=ANSWER, label="42")
        self.bus.publish("trajectories", finished, **ids, event_id=f"{prefix}:finished")
        reward = RewardAssigned(reward=0.5, advantage=0.0, source="exact_match", role_rewards=ROLE_REWARDS,
                                role_advantages=ROLE_ADVANTAGES)
        self.bus.publish("rewards", reward, event_id=f"{rollout}:reward", **ids)

    def fleet_versions(self, url: str) -> None:
        """What the trainer records of the server: the whole policy's version, and each adapter's."""
        self.bus.redis.hset(FLEET_VERSIONS.key(self.bus.keys),
                            mapping={version_field(url, role): version
                                     for role, version in FLEET_VERSIONS_HELD.items()})

    def reward(self, rollout: str, group: str, reward: float, advantage: float) -> None:
        self.bus.publish("rewards", RewardAssigned(reward=reward, advantage=advantage, source="exact_match"),
                         event_id=f"{rollout}:reward", **self.ids(rollout, group))

    def batch(self, rollout: str, group: str, segment: Segment) -> str:
        batch_id = f"b-{group}"
        row = BatchRow(sample_index=0, trajectory_id=rollout, rollout_id=rollout, group_id=group,
                       session_id=rollout, segment_index=0, tokens=segment.tokens,
                       response_length=segment.response_length, loss_mask=segment.loss_mask,
                       rollout_logprobs=segment.rollout_logprobs,
                       turn_policy_versions=segment.turn_policy_versions, status="completed", reward=1.0,
                       advantage=0.0)
        uri = write_batch(self.storage, self.run, batch_id, [row])
        # the trainer held v0 and saw each sampled token TRAINER_GAP likelier than vLLM did
        trainer = [lp + TRAINER_GAP if sampled else 0.0
                   for lp, sampled in zip(row.rollout_logprobs, row.loss_mask)]
        written = TrainerLogprobs(rollout_id=rollout, segment_index=0, policy_version=0, logprobs=trainer)
        write_trainer_logprobs(self.storage, self.run, batch_id, [written])
        ready = BatchReady(batch_id=batch_id, uri=uri, sample_count=1, group_ids=[group],
                           min_policy_version=0, mean_reward=1.0)
        self.bus.publish("batches", ready, event_id=f"{batch_id}:ready")
        self.bus.publish("policy", PolicyUpdated(version=1, checkpoint_uri=self.storage.path(self.run, "v1"),
                                                 batch_id=batch_id, servers=[SERVER], parity_max_abs_diff=0.0,
                                                 loss=0.25, trained_samples=1, dropped={"stale": 2},
                                                 metrics={"samples/staleness_mean": 0.5,
                                                          "samples/staleness_max": 1.0},
                                                 role_versions={"planner": 1, "solver": 0}),
                         event_id="policy:v1")
        return batch_id

    def consumers_and_dead_letters(self) -> None:
        """A replica of the agent-runner holding one prompt, and junk on `grades` that the reward group's
        consumer dead-letters (it does not decode)."""
        self.bus.ensure_group("prompts", "agent-runner")
        prompts, grades = self.bus.keys.stream("prompts"), self.bus.keys.stream("grades")
        self.bus.redis.xreadgroup("agent-runner", AGENT_RUNNER, {prompts: ">"}, count=1)
        self.bus.ensure_group("grades", "reward")
        self.bus.redis.xadd(grades, {"type": "NoSuchEvent", "v": "1", "body": b"\x80"})
        self.bus.consume("grades", "reward", "reward-host-7", block_ms=1)


def publish_run(bus: Bus, storage: Path, encode, fleet_url: str) -> PublishedRun:
    builder = RunBuilder(bus, str(storage), encode)
    run = bus.keys.run_id
    names = ("calculator", "coding", "session", "dropped", "roles")
    rollouts = {name: f"{run}-r{index:07d}" for index, name in enumerate(names)}
    segment = builder.calculator(rollouts["calculator"], f"{run}-g000000")
    builder.coding(rollouts["coding"], f"{run}-g000001")
    builder.session(rollouts["session"], f"{run}-g000001")
    builder.dropped(rollouts["dropped"], f"{run}-g000001")
    builder.roles(rollouts["roles"], f"{run}-g000002")
    batch_id = builder.batch(rollouts["calculator"], f"{run}-g000000", segment)
    builder.consumers_and_dead_letters()
    builder.fleet_versions(fleet_url)
    return PublishedRun(run, str(storage), rollouts, batch_id, fleet_url)
