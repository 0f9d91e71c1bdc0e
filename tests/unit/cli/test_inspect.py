"""`rollstream inspect` on real Redis 7.0 and Valkey with real archives: a small run is published event by
event (prompts, turns with known token ids and logprobs, a tool call, grade, rewards, a real Parquet batch,
a policy update), part of it archived and trimmed, and the commands' output is checked for content."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass

import msgspec
import pytest
from rich.console import Console
from typer.testing import CliRunner

from rollstream.cli.inspect.app import inspect_app
from rollstream.cli.inspect.diff import diff_runs, render_diff
from rollstream.cli.inspect.runs import collect_runs, runs_table
from rollstream.cli.inspect.trajectory import render_rollout, tokens_text
from rollstream.services.recorder.archive_writer import ArchiveWriter
from rollstream.shared.contract.archive import trim_stream
from rollstream.shared.contract.batches import BatchRow, write_batch
from rollstream.shared.contract.bus import STREAMS, Bus
from rollstream.shared.contract.events import (
    BatchReady,
    GradeReported,
    GradingFailed,
    PolicyUpdated,
    PromptIssued,
    RewardAssigned,
    TrajectoryFinished,
    TrajectorySegment,
    TrajectoryStarted,
    TrajectoryTool,
    TrajectoryTurn,
)
from rollstream.shared.contract.rollout_view import load_decoder, load_rollout, rollout_document
from rollstream.shared.contract.run_source import open_run
from rollstream.shared.contract.stream_state import collect_streams
from rollstream.shared.runtime.storage import Storage
from tests.support import MODELS

MODEL = MODELS / "tiny-llama"
SERVER = "http://127.0.0.1:8000"
QUESTION = "What is 40+2?"
TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "40+2"}}</tool_call>'
ANSWER = "The answer is 42."
ANSWER_LOGPROBS = [-0.1, -0.3, -1.0, -1.5, -3.0, -0.2, -5.0]  # The, ' answer', ' is', ' ', '4', '2', '.'
ANSWER_STYLES = ["green", "green", "yellow", "yellow", "red", "green", "red"]
runner = CliRunner(env={"COLUMNS": None})
"""As piped output, whatever width the test runner sets (pytest-xdist's workers say 80 columns)."""


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(MODEL / "tokenizer.json"))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


@dataclass
class Built:
    run: str
    rollouts: list[str]
    group: str
    batch_id: str
    attempt: str


def build_run(bus: Bus, storage: str, tokenizer, r1_reward: float = 0.0, r1_advantage: float = -0.7071,
              r1_row_advantage: float | None = None, grade_duration_s: float = 0.25) -> Built:
    """A two-rollout group as the services publish it (deterministic event ids, random attempts)."""
    run = bus.keys.run_id
    r0, r1 = f"{run}-r0000000", f"{run}-r0000001"
    group = f"{run}-g000000"

    def ids(rollout: str) -> dict:
        return {"rollout_id": rollout, "group_id": group, "trajectory_id": rollout, "session_id": rollout}

    for i, rollout in enumerate((r0, r1)):
        bus.publish("prompts", PromptIssued(sample_index=i, group_size=2,
                                            messages=[{"role": "user", "content": QUESTION}], label="42",
                                            tools=["calculator"], policy_version=0),
                    event_id=f"{rollout}:prompt", **ids(rollout))

    prompt_ids = encode(tokenizer, f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    call_ids = encode(tokenizer, TOOL_CALL)
    observation_ids = encode(tokenizer,
                             "<|im_end|>\n<|im_start|>tool\n<tool_response>42</tool_response><|im_end|>\n"
                             "<|im_start|>assistant\n")
    answer_ids = encode(tokenizer, ANSWER)
    assert len(answer_ids) == len(ANSWER_LOGPROBS)
    attempt = uuid.uuid4().hex[:12]

    def publish(event, suffix):
        return bus.publish("trajectories", event, event_id=f"{r0}:{attempt}:{suffix}", **ids(r0))

    publish(TrajectoryStarted(sample_index=0, server_url=SERVER), "started")
    publish(TrajectoryTurn(turn=0, offset=len(prompt_ids), appended_ids=prompt_ids, response_ids=call_ids,
                           logprobs=[-0.05] * len(call_ids), policy_version=0, policy_version_end=0,
                           finish_reason="stop", server_url=SERVER), "turn:0:0")
    offset = len(prompt_ids) + len(call_ids) + len(observation_ids)
    publish(TrajectoryTurn(turn=1, offset=offset, appended_ids=observation_ids, response_ids=answer_ids,
                           logprobs=ANSWER_LOGPROBS, policy_version=0, policy_version_end=1,
                           finish_reason="stop", server_url=SERVER), "turn:0:1")
    publish(TrajectoryTool(turn=0, call_id="call-0", name="calculator",
                           arguments={"expression": "40+2"}, ok=True, content="42"), "tool:0:call-0")
    tokens0 = prompt_ids + call_ids + observation_ids + answer_ids
    mask0 = [0] * len(prompt_ids) + [1] * len(call_ids) + [0] * len(observation_ids) + [1] * len(answer_ids)
    logprobs0 = ([0.0] * len(prompt_ids) + [-0.05] * len(call_ids) + [0.0] * len(observation_ids)
                 + ANSWER_LOGPROBS)
    publish(TrajectorySegment(segment_index=0, attempt=attempt, tokens=tokens0,
                              response_length=len(tokens0) - len(prompt_ids), loss_mask=mask0,
                              rollout_logprobs=logprobs0, turn_policy_versions=[0, 0], status="completed",
                              response_text=ANSWER, sample_index=0, group_size=2), "segment:0")
    publish(TrajectoryFinished(status="completed", attempt=attempt, segment_count=1, group_size=2,
                               sample_index=0, response_text=ANSWER, label="42"), "finished")

    attempt1 = uuid.uuid4().hex[:12]
    wrong = encode(tokenizer, "41")

    def publish1(event, suffix):
        return bus.publish("trajectories", event, event_id=f"{r1}:{attempt1}:{suffix}", **ids(r1))

    publish1(TrajectoryStarted(sample_index=1, server_url=SERVER), "started")
    publish1(TrajectoryTurn(turn=0, offset=len(prompt_ids), appended_ids=prompt_ids, response_ids=wrong,
                            logprobs=[-2.5] * len(wrong), policy_version=1, policy_version_end=1,
                            finish_reason="stop", server_url=SERVER), "turn:0:0")
    tokens1 = prompt_ids + wrong
    publish1(TrajectorySegment(segment_index=0, attempt=attempt1, tokens=tokens1, response_length=len(wrong),
                               loss_mask=[0] * len(prompt_ids) + [1] * len(wrong),
                               rollout_logprobs=[0.0] * len(prompt_ids) + [-2.5] * len(wrong),
                               turn_policy_versions=[1], status="completed", response_text="41",
                               sample_index=1, group_size=2), "segment:0")
    publish1(TrajectoryFinished(status="completed", attempt=attempt1, segment_count=1, group_size=2,
                                sample_index=1, response_text="41", label="42"), "finished")

    bus.publish("grades",
                GradeReported(score=1.0, passed=True, reason="exit status 0", duration_s=grade_duration_s),
                event_id=f"{r0}:grade", **ids(r0))
    rewards = {r0: (1.0, 0.7071), r1: (r1_reward, r1_advantage)}
    for rollout, (reward, advantage) in rewards.items():
        bus.publish("rewards", RewardAssigned(reward=reward, advantage=advantage, source="exact_match"),
                    event_id=f"{rollout}:reward", **ids(rollout))

    batch_id = "b-" + hashlib.sha1(group.encode()).hexdigest()[:16]
    row_advantage = {r0: 0.7071, r1: r1_advantage if r1_row_advantage is None else r1_row_advantage}
    rows = [BatchRow(sample_index=i, trajectory_id=rollout, rollout_id=rollout, group_id=group,
                     session_id=rollout, segment_index=0, tokens=tokens,
                     response_length=len(tokens) - len(prompt_ids), loss_mask=mask, rollout_logprobs=logprobs,
                     turn_policy_versions=versions, status="completed", reward=rewards[rollout][0],
                     advantage=row_advantage[rollout])
            for i, (rollout, tokens, mask, logprobs, versions) in enumerate((
                (r0, tokens0, mask0, logprobs0, [0, 0]),
                (r1, tokens1, [0] * len(prompt_ids) + [1] * len(wrong),
                 [0.0] * len(prompt_ids) + [-2.5] * len(wrong), [1])))]
    uri = write_batch(Storage(storage), run, batch_id, rows)
    bus.publish("batches", BatchReady(batch_id=batch_id, uri=uri, sample_count=2, group_ids=[group],
                                      min_policy_version=0, mean_reward=(1.0 + r1_reward) / 2),
                event_id=f"{batch_id}:ready")
    bus.publish("policy", PolicyUpdated(version=1,
                                        checkpoint_uri=f"{Storage(storage).root}/{run}/checkpoints/v1",
                                        batch_id=batch_id, servers=[SERVER], parity_max_abs_diff=0.0,
                                        loss=0.125, trained_samples=2), event_id="policy:v1")
    return Built(run, [r0, r1], group, batch_id, attempt)


def set_up_groups_and_trim(bus: Bus, storage: str) -> int:
    """prompts: a group with one entry pending and one undelivered, and a group created mid-stream;
    trajectories: read and acked by `reward`, archived, then trimmed (all but the newest entry)."""
    prompts = bus.keys.stream("prompts")
    bus.ensure_group("prompts", "agent-runner")
    bus.redis.xreadgroup("agent-runner", "runner-1", {prompts: ">"}, count=1)
    first = bus.redis.xrange(prompts, count=1)[0][0]
    bus.redis.xgroup_create(prompts, "late", id=first)  # Redis 7.0 cannot tell this group's lag
    trajectories = bus.keys.stream("trajectories")
    bus.ensure_group("trajectories", "reward")
    delivered = bus.redis.xreadgroup("reward", "reward-1", {trajectories: ">"}, count=100)[0][1]
    bus.redis.xack(trajectories, "reward", *[entry_id for entry_id, _ in delivered])
    ArchiveWriter(Storage(storage), bus.keys.run_id).archive_new(bus, "trajectories", 1000)
    return trim_stream(bus, "trajectories")


def archive_everything(bus: Bus, storage: str) -> None:
    writer = ArchiveWriter(Storage(storage), bus.keys.run_id)
    for stream in STREAMS:
        writer.archive_new(bus, stream, 1000)


def rendered(renderable, width: int = 220) -> str:
    console = Console(record=True, width=width, force_terminal=True, color_system="truecolor")
    console.print(renderable)
    return console.export_text()


def row_cells(text: str, first: str) -> list[str]:
    """The cells of the table row whose first cell is `first`."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("│┃").split("│")]
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n{text}")


def base_args(bus: Bus, storage) -> list[str]:
    kwargs = bus.redis.connection_pool.connection_kwargs
    url = f"redis://{kwargs.get('host', '127.0.0.1')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
    return ["--redis-url", url, "--storage", str(storage)]


# ---------------------------------------------------------------------------------------------- runs
def test_runs_lists_a_live_run_then_the_same_run_from_its_archive_only(bus, tmp_path, tokenizer):
    built = build_run(bus, str(tmp_path), tokenizer)
    assert set_up_groups_and_trim(bus, str(tmp_path)) == 9
    # prompts .. dead: entries ever added; latest policy
    expected = ["2", "10", "1", "2", "1", "1", "0", "v1"]

    summaries = [s for s in collect_runs(bus.redis, str(tmp_path)) if s.run == built.run]
    assert len(summaries) == 1 and summaries[0].where == "both"
    assert row_cells(rendered(runs_table(summaries)), built.run)[1:] == ["both", *expected]

    result = runner.invoke(inspect_app, ["runs", *base_args(bus, tmp_path)])
    assert result.exit_code == 0, result.output
    assert row_cells(result.stdout, built.run)[1:] == ["both", *expected]

    archive_everything(bus, str(tmp_path))
    bus.delete_run()
    (summary,) = [s for s in collect_runs(bus.redis, str(tmp_path)) if s.run == built.run]
    assert summary.where == "archive"
    assert row_cells(rendered(runs_table([summary])), built.run)[1:] == ["archive", *expected]


# ------------------------------------------------------------------------------------------- streams
def test_streams_shows_lengths_archive_position_and_each_groups_lag_and_pending(bus, tmp_path, tokenizer):
    build_run(bus, str(tmp_path), tokenizer)
    set_up_groups_and_trim(bus, str(tmp_path))
    trajectory_ids = [e.decode() for e, _ in bus.redis.xrange(bus.keys.stream("trajectories"))]
    prompt_ids = [e.decode() for e, _ in bus.redis.xrange(bus.keys.stream("prompts"))]

    states = {s.stream: s for s in collect_streams(open_run(bus.redis, str(tmp_path), bus.keys.run_id))}
    groups = {g.name: g for g in states["prompts"].groups}
    assert (groups["agent-runner"].lag, groups["agent-runner"].pending,
            groups["agent-runner"].consumers) == (1, 1, 1)
    assert (groups["late"].lag, groups["late"].pending, groups["late"].consumers) == (1, 0, 0)
    (reward,) = states["trajectories"].groups
    assert (reward.name, reward.lag, reward.pending) == ("reward", 0, 0)
    assert (states["trajectories"].length, states["trajectories"].added,
            states["trajectories"].archived_entries) == (1, 10, 10)
    assert states["trajectories"].archived_to == trajectory_ids[-1] == states["trajectories"].first_id
    assert not states["dead"].live

    result = runner.invoke(inspect_app, ["streams", bus.keys.run_id, *base_args(bus, tmp_path)])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert row_cells(text, "prompts") == ["prompts", "2", "2", prompt_ids[0], prompt_ids[1], "-", "-",
                                          "agent-runner", "1", "1", "1"]
    late = row_cells(text, "")  # the second group of prompts, beneath it
    assert late[7:9] == ["late", "0"] and late[9] in ("1", "1*") and late[10] == "0"
    assert row_cells(text, "trajectories") == ["trajectories", "1", "10", trajectory_ids[0],
                                               trajectory_ids[0], trajectory_ids[0], "10", "reward",
                                               "1", "0", "0"]
    assert row_cells(text, "dead")[1] == "not live"


def test_streams_of_an_unknown_run_fails_clearly(bus, tmp_path):
    result = runner.invoke(inspect_app, ["streams", "no-such-run-xyz", *base_args(bus, tmp_path)])
    assert result.exit_code == 1
    assert "no run 'no-such-run-xyz'" in result.output


# ---------------------------------------------------------------------------------------- trajectory
def test_trajectory_renders_a_trimmed_rollout_turn_by_turn(bus, tmp_path, tokenizer):
    built = build_run(bus, str(tmp_path), tokenizer)
    set_up_groups_and_trim(bus, str(tmp_path))
    # the rollout's turns are only in the archive now
    assert bus.redis.xlen(bus.keys.stream("trajectories")) == 1

    decoder, _ = load_decoder(MODEL)
    view = load_rollout(open_run(bus.redis, str(tmp_path), built.run), built.rollouts[0])
    doc = rollout_document(view, decoder)
    text = " ".join(rendered(render_rollout(doc)).split())
    assert ANSWER in text and TOOL_CALL in text
    assert f"user: {QUESTION}" in text and "label '42'" in text and "sample 0 of a group of 2" in text
    assert "segment 0 turn 0 policy v0 finish stop" in text
    assert "segment 0 turn 1 policy v0 -> v1 (weights synced mid-turn)" in text
    assert 'tool calculator({"expression": "40+2"}) -> ok: 42' in text
    assert f"TrajectoryFinished status completed, 1 segment(s) response_text: {ANSWER}" in text
    assert "GradeReported score 1.0, passed, reason 'exit status 0'" in text
    assert "RewardAssigned reward 1.0, advantage 0.7071, source exact_match" in text
    assert f"BatchReady {built.batch_id}: 2 samples" in text and "trained into v1" in text
    assert "row segment 0" in text and "advantage 0.7071" in text

    # tokens coloured by logprob; context dim
    turn = doc["attempts"][0]["turns"][1]
    response = [t for t in turn["tokens"] if t["mask"]]
    spans = tokens_text(response).spans
    assert [s.style for s in spans] == ANSWER_STYLES
    assert {s.style for s in tokens_text([t for t in turn["tokens"] if not t["mask"]]).spans} == {"dim"}
    console = Console(width=220, force_terminal=True, color_system="truecolor")
    segments = [(s.text, s.style) for s in console.render(render_rollout(doc)) if s.style is not None]
    styled = {(text_, str(style)) for text_, style in segments}
    assert (" answer", "green") in styled and (" is", "yellow") in styled and (".", "red") in styled
    assert ("<tool_response>", "dim") in styled
    assert "logprob >= -0.5" in text  # the legend

    result = runner.invoke(inspect_app, ["trajectory", built.run, built.rollouts[0], "--model", str(MODEL),
                                         *base_args(bus, tmp_path)])
    assert result.exit_code == 0, result.output
    assert ANSWER in result.stdout and "weights synced mid-turn" in result.stdout


def test_trajectory_json_has_per_token_ids_text_logprobs_mask_and_versions(bus, tmp_path, tokenizer):
    built = build_run(bus, str(tmp_path), tokenizer)
    set_up_groups_and_trim(bus, str(tmp_path))
    result = runner.invoke(inspect_app, ["trajectory", built.run, built.rollouts[0], "--json",
                                         "--model", str(MODEL), *base_args(bus, tmp_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    (attempt,) = doc["attempts"]
    assert attempt["attempt"] == built.attempt
    first, second = attempt["turns"]
    response = [t for t in second["tokens"] if t["mask"] == 1]
    context = [t for t in second["tokens"] if t["mask"] == 0]
    assert [t["id"] for t in response] == encode(tokenizer, ANSWER)
    assert "".join(t["text"] for t in response) == ANSWER == second["response_text"]
    assert [t["logprob"] for t in response] == ANSWER_LOGPROBS
    assert {(t["policy_version"], t["policy_version_end"]) for t in response} == {(0, 1)}
    assert second["synced_mid_turn"] and not first["synced_mid_turn"]
    assert (context and all(t["logprob"] is None for t in context)
            and second["tokens"][:len(context)] == context)
    assert "<tool_response>42</tool_response>" in second["context_text"]
    assert first["tools"] == [{"call_id": "call-0", "name": "calculator", "arguments": {"expression": "40+2"},
                               "ok": True, "error_kind": None, "content": "42"}]
    assert doc["prompt"]["messages"] == [{"role": "user", "content": QUESTION}]
    assert doc["prompt"]["group_size"] == 2
    assert attempt["finished"]["response_text"] == ANSWER and attempt["finished"]["segment_count"] == 1
    assert [(g["score"], g["passed"]) for g in doc["grades"]] == [(1.0, True)]
    assert [(r["reward"], r["advantage"], r["source"]) for r in doc["rewards"]] == [
        (1.0, 0.7071, "exact_match")]
    (batch,) = doc["batches"]
    assert (batch["batch_id"], batch["group_ids"],
            batch["trained_in"]) == (built.batch_id, [built.group], [1])
    assert [(r["segment_index"], r["advantage"]) for r in batch["rows"]] == [(0, 0.7071)]
    # a run of one role, without its settings at hand: its role is the unnamed default, not worth showing
    assert (doc["roles"], doc["roles_shown"]) == (["default"], False)
    assert [r["role"] for r in batch["rows"]] == ["default"] and attempt["segments"][0]["role"] == "default"


def test_trajectory_without_a_tokenizer_shows_ids_and_an_unknown_rollout_lists_real_ones(bus, tmp_path,
                                                                                         tokenizer):
    built = build_run(bus, str(tmp_path), tokenizer)
    result = runner.invoke(inspect_app, ["trajectory", built.run, built.rollouts[1], "--json", "--model",
                                         str(tmp_path / "no-model"), *base_args(bus, tmp_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["tokenizer"] is None
    response = [t for t in doc["attempts"][0]["turns"][0]["tokens"] if t["mask"]]
    assert [t["text"] for t in response] == [f"{i} " for i in encode(tokenizer, "41")]
    assert [t["logprob"] for t in response] == [-2.5] * len(response)

    result = runner.invoke(inspect_app, ["trajectory", built.run, "nope", *base_args(bus, tmp_path)])
    assert result.exit_code == 1
    output = " ".join(result.output.split())
    assert "no rollout 'nope'" in output and built.rollouts[0] in output and built.rollouts[1] in output


def test_trajectory_shows_a_grading_that_could_not_run_as_such(bus, tmp_path, tokenizer):
    built = build_run(bus, str(tmp_path), tokenizer)
    rollout = built.rollouts[1]
    bus.publish("grades", GradingFailed(reason="grading failed and no retry is left: WorkspaceError: "
                                               "unreachable", attempts=4),
                event_id=f"{rollout}:grade", rollout_id=rollout,
                trajectory_id=rollout, session_id=rollout)
    view = load_rollout(open_run(bus.redis, str(tmp_path), built.run), rollout)
    doc = rollout_document(view, None)
    assert [(g["type"], g["attempts"]) for g in doc["grades"]] == [("GradingFailed", 4)]
    text = " ".join(rendered(render_rollout(doc)).split())
    assert "GradingFailed the sandbox could not grade it after 4 attempt(s)" in text
    assert "no reward, left out of its group's batch" in text


# ----------------------------------------------------------------------------------------------- roles
TWO_ROLES = {"planner": {}, "solver": {}}
ROLE_TURNS = {"planner": ((3, 3), (4, 4)), "solver": ((1, 2), (2, 2))}
"""Each role's segment's turns: (policy_version, policy_version_end) of its role; the solver's weights were
synced in its first turn."""


def publish_role_segment(bus: Bus, ids: dict, index: int, role: str, prompt_ids: list[int],
                         answer_ids: list[int]) -> BatchRow:
    """The role's segment (ROLE_TURNS: its turns' versions) on `trajectories`, and its batch row. The
    planner's names no role: it is the run's default role."""
    rollout, named = ids["rollout_id"], None if role == "planner" else role
    for number, (start, end) in enumerate(ROLE_TURNS[role]):
        turn = TrajectoryTurn(segment_index=index, turn=number, offset=len(prompt_ids),
                              appended_ids=prompt_ids, response_ids=answer_ids,
                              logprobs=[-0.1] * len(answer_ids), policy_version=start, policy_version_end=end,
                              finish_reason="stop", server_url=SERVER)
        bus.publish("trajectories", turn, event_id=f"{rollout}:a0:turn:{index}:{number}", **ids)
    tokens = prompt_ids + answer_ids
    mask = [0] * len(prompt_ids) + [1] * len(answer_ids)
    logprobs = [0.0] * len(prompt_ids) + [-0.1] * len(answer_ids)
    versions = [start for start, _ in ROLE_TURNS[role]]
    segment = TrajectorySegment(segment_index=index, attempt="a0", tokens=tokens,
                                response_length=len(answer_ids), loss_mask=mask, rollout_logprobs=logprobs,
                                turn_policy_versions=versions, status="completed", response_text=ANSWER,
                                sample_index=0, group_size=1, role=named)
    bus.publish("trajectories", segment, event_id=f"{rollout}:a0:segment:{index}", **ids)
    return BatchRow(sample_index=0, trajectory_id=rollout, rollout_id=rollout, group_id=ids["group_id"],
                    session_id=rollout, segment_index=index, tokens=tokens, response_length=len(answer_ids),
                    loss_mask=mask, rollout_logprobs=logprobs, turn_policy_versions=versions,
                    status="completed", reward=1.0 - index, advantage=0.5 - index, role=named)


def build_two_role_rollout(bus: Bus, storage: str, tokenizer) -> str:
    """A rollout of a planner segment and a solver segment, rewarded per role, in a batch whose training step
    gave each role a version; and the run's config.json, whose default role is the planner."""
    run = bus.keys.run_id
    rollout, group = f"{run}-r0000000", f"{run}-g000000"
    ids = {"rollout_id": rollout, "group_id": group, "trajectory_id": rollout, "session_id": rollout}
    config = {"roles": {"names": TWO_ROLES}, "model": {"path": str(MODEL)}}
    Storage(storage).write_bytes(json.dumps(config).encode(), run, "config.json")
    prompt = PromptIssued(sample_index=0, group_size=1, messages=[{"role": "user", "content": QUESTION}],
                          label="42", policy_version=0)
    bus.publish("prompts", prompt, event_id=f"{rollout}:prompt", **ids)
    prompt_ids = encode(tokenizer, f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    rows = [publish_role_segment(bus, ids, index, role, prompt_ids, encode(tokenizer, ANSWER))
            for index, role in enumerate(ROLE_TURNS)]
    bus.publish("rewards", RewardAssigned(reward=0.5, advantage=0.0, source="exact_match",
                                          role_rewards={"planner": 1.0, "solver": 0.0},
                                          role_advantages={"planner": 0.5, "solver": -0.5}),
                event_id=f"{rollout}:reward", **ids)
    uri = write_batch(Storage(storage), run, "b-roles", rows)
    bus.publish("batches", BatchReady(batch_id="b-roles", uri=uri, sample_count=2, group_ids=[group],
                                      min_policy_version=1, mean_reward=0.5), event_id="b-roles:ready")
    update = PolicyUpdated(version=5, checkpoint_uri=f"{storage}/{run}/checkpoints/v5", batch_id="b-roles",
                           servers=[SERVER], parity_max_abs_diff=0.0, loss=0.1, trained_samples=2,
                           role_versions={"planner": 4, "solver": 2})
    bus.publish("policy", update, event_id="policy:v5")
    return rollout


def test_trajectory_of_two_roles_shows_each_segments_role_and_each_turns_role_version(bus, tmp_path,
                                                                                       tokenizer):
    rollout = build_two_role_rollout(bus, str(tmp_path), tokenizer)
    view = load_rollout(open_run(bus.redis, str(tmp_path), bus.keys.run_id), rollout)
    text = " ".join(rendered(render_rollout(rollout_document(view, None, "planner"))).split())
    assert "roles planner, solver" in text
    assert "segment 0 turn 0 planner v3 finish" in text and "segment 0 turn 1 planner v4 finish" in text
    assert "segment 1 turn 0 solver v1 -> v2 (weights synced mid-turn)" in text
    assert "segment 1 turn 1 solver v2 finish" in text
    assert "segment 0 (planner): completed" in text and "turn versions planner v3, planner v4" in text
    assert "segment 1 (solver): completed" in text and "turn versions solver v1, solver v2" in text
    assert ("RewardAssigned reward 0.5, advantage 0.0, source exact_match; per role: rewards planner 1.0, "
            "solver 0.0; per role: advantages planner 0.5, solver -0.5") in text
    assert "trained into v5 (planner v4, solver v2)" in text
    assert "row segment 0 (planner):" in text and "row segment 1 (solver):" in text

    # the CLI names the default role as the run's config.json does
    result = runner.invoke(inspect_app, ["trajectory", bus.keys.run_id, rollout, "--json",
                                         *base_args(bus, tmp_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["default_role"], doc["roles"], doc["roles_shown"]) == ("planner", ["planner", "solver"], True)
    (attempt,) = doc["attempts"]
    assert [(t["role"], t["policy_version"]) for t in attempt["turns"]] == [
        ("planner", 3), ("planner", 4), ("solver", 1), ("solver", 2)]
    assert [(r["role"], r["advantage"]) for r in doc["batches"][0]["rows"]] == [("planner", 0.5),
                                                                                ("solver", -0.5)]

    (summary,) = [s for s in collect_runs(bus.redis, str(tmp_path)) if s.run == bus.keys.run_id]
    assert row_cells(rendered(runs_table([summary])), bus.keys.run_id)[-1] == "v5 (planner v4, solver v2)"


def test_a_rollout_of_one_role_other_than_the_default_shows_it(bus, tmp_path, tokenizer):
    rollout = build_two_role_rollout(bus, str(tmp_path), tokenizer)
    view = load_rollout(open_run(bus.redis, str(tmp_path), bus.keys.run_id), rollout)
    for attempt in view.attempts:  # the planner's segment and turns left out: the solver's alone remain
        attempt.segments = [s for s in attempt.segments if s.payload.role == "solver"]
        attempt.turns = [t for t in attempt.turns if t.payload.segment_index == 1]
    # the solver scored by a reward function of its own; its advantage the rollout's
    (reward,) = view.rewards
    view.rewards = [msgspec.structs.replace(reward, payload=reward.payload.model_copy(
        update={"role_rewards": {"solver": 0.25}, "role_advantages": {"solver": 0.0}}))]
    doc = rollout_document(view, None, "planner")
    assert (doc["roles"], doc["roles_shown"]) == (["solver"], True)
    text = " ".join(rendered(render_rollout(doc)).split())
    assert "segment 1 turn 1 solver v2 finish" in text
    assert "advantage 0.0, source exact_match; per role: rewards solver 0.25" in text
    assert "per role: advantages" not in text


# ---------------------------------------------------------------------------------------------- diff
def test_diff_finds_exactly_the_changed_reward_and_batch_row(bus, tmp_path, tokenizer):
    storage = str(tmp_path)
    a = build_run(bus, storage, tokenizer)
    set_up_groups_and_trim(bus, storage)
    others = {name: Bus(bus.redis, f"{bus.keys.run_id}-{name}")
              for name in ("same", "changed", "rows", "archived", "slower")}
    try:
        build_run(others["same"], storage, tokenizer)
        changed = build_run(others["changed"], storage, tokenizer, r1_reward=1.0, r1_advantage=0.5)
        build_run(others["rows"], storage, tokenizer, r1_row_advantage=-0.25)
        build_run(others["archived"], storage, tokenizer)
        build_run(others["slower"], storage, tokenizer, grade_duration_s=0.5)
        archive_everything(others["archived"], storage)
        others["archived"].delete_run()

        def diff(name: str, *extra: str):
            return runner.invoke(inspect_app,
                                 ["diff", a.run, others[name].keys.run_id, *base_args(bus, tmp_path), *extra])

        # another run of the same events: other run id, attempts, times, batch id; identical
        for name in ("same", "archived"):
            result = diff(name)
            assert result.exit_code == 0, result.output
            assert result.stdout.strip().splitlines()[-1].startswith("identical:")
            for stream in STREAMS:
                assert row_cells(result.stdout, stream)[2:] == ["0", "0", "0"]
            assert row_cells(result.stdout, "trajectories")[1] == "10"

        report = diff_runs(open_run(bus.redis, storage, a.run), open_run(bus.redis, storage, changed.run))
        by_stream = {s.stream: s for s in report.streams}
        assert not report.identical
        assert [s.stream for s in report.streams if s.differs] == ["rewards", "batches"]
        (reward,) = by_stream["rewards"].different
        assert reward.key == f"{a.rollouts[1]}:reward"
        assert [(c.name, c.a, c.b) for c in reward.changes] == [("reward", 0.0, 1.0),
                                                                ("advantage", -0.7071, 0.5)]
        assert by_stream["rewards"].identical == 1
        (batch,) = by_stream["batches"].different
        assert [(c.name, c.a, c.b) for c in batch.changes] == [("mean_reward", 0.5, 1.0)]
        ((row, columns),) = batch.rows.changed
        assert row == f"({a.rollouts[1]}, 0)"
        assert [c.name for c in columns] == ["reward", "advantage"]
        assert [(c.a, c.b) for c in columns] == [(0.0, 1.0), (-0.7071, 0.5)]
        text = " ".join(rendered(render_diff(report)).split())
        assert f"rewards {a.rollouts[1]}:reward: reward 0.0 -> 1.0, advantage -0.7071 -> 0.5" in text

        result = diff("changed", "--streams", "rewards,batches")
        assert result.exit_code == 1, result.output
        assert f"rewards {a.rollouts[1]}:reward: reward 0.0 -> 1.0, advantage -0.7071 -> 0.5" in result.stdout
        assert f"row ({a.rollouts[1]}, 0): reward 0.0 -> 1.0, advantage -0.7071 -> 0.5" in result.stdout
        assert result.stdout.strip().splitlines()[-1].startswith("different:")
        assert row_cells(result.stdout, "rewards")[1:] == ["1", "0", "0", "1"]
        assert row_cells(result.stdout, "batches")[1:] == ["0", "0", "0", "1"]

        # only the batch file differs: the event is the same, its rows are not
        result = diff("rows", "--streams", "batches")
        assert result.exit_code == 1, result.output
        assert ": event identical" in result.stdout
        assert f"row ({a.rollouts[1]}, 0): advantage" in result.stdout

        result = diff("changed", "--streams", "prompts,trajectories,grades,policy")
        assert result.exit_code == 0, result.output
        # a wall-clock measurement is no difference, unless asked for
        assert diff("slower").exit_code == 0
        result = diff("slower", "--exact")
        assert result.exit_code == 1 and "duration_s 0.25 -> 0.5" in result.stdout
        result = diff("changed", "--streams", "nonsense")
        assert result.exit_code == 2 and "unknown stream" in result.output
    finally:
        for other in others.values():
            other.delete_run()
