"""The event models (shared/contract/event_models/) and the contract they make up (events.py): each type's
bounds and validators, every model's fields documented where they are declared, every event class naming the
consumer groups that read it, and every event carried by exactly one stream (streams.py).

    python -m pytest tests/unit/shared/contract/test_events.py -q
"""

import ast
import importlib

import msgspec
import pytest
from pydantic import BaseModel, ValidationError

from rollstream.shared.contract import events
from rollstream.shared.contract.consumers import groups_reading
from rollstream.shared.contract.events import (
    EVENT_TYPES,
    STREAM_EVENTS,
    STREAMS,
    BatchReady,
    Event,
    EventDecodeError,
    GradeReported,
    PolicyUpdated,
    PromptIssued,
    RewardAssigned,
    TrajectoryFinished,
    TrajectorySegment,
    decode,
    encode,
    make_envelope,
)
from tests.support import REPO

EVENT_MODULES = sorted((REPO / "shared" / "contract" / "event_models").glob("*.py"))
"""The contract's event models, one module per stage: their source is their documentation."""


def event_classes_defined() -> list[type[Event]]:
    """Every event class the event models' modules define."""
    found = []
    for path in EVENT_MODULES:
        name = "rollstream.shared.contract.event_models"
        if path.stem != "__init__":
            name += f".{path.stem}"
        found += [value for value in vars(importlib.import_module(name)).values()
                  if isinstance(value, type) and issubclass(value, Event) and value is not Event
                  and value.__module__ == name]
    return found


def segment(**overrides):
    fields = dict(segment_index=0, tokens=[5, 6, 7, 8], response_length=2, loss_mask=[0, 0, 1, 1],
                  rollout_logprobs=[0.0, 0.0, -0.5, -1.25], turn_policy_versions=[3], status="completed",
                  response_text="42", sample_index=9, group_size=4)
    return TrajectorySegment(**{**fields, **overrides})


def test_token_arrays_given_as_lists_are_validated_as_lists():
    with pytest.raises(ValidationError, match="tokens"):
        segment(tokens=[5, 6, "seven", 8])


def test_every_event_type_has_a_unique_name_and_a_version():
    assert len(EVENT_TYPES) == len({cls.TYPE for cls in EVENT_TYPES.values()})
    assert all(cls.VERSION >= 1 for cls in EVENT_TYPES.values())


@pytest.mark.parametrize("event_type, field, value", [
    ("TrajectorySegment", "group_size", 0),
    ("TrajectorySegment", "sample_index", -1),
    ("TrajectorySegment", "turn_policy_versions", [-2]),
    ("TrajectoryFinished", "segment_count", 0),
    ("GradeReported", "score", float("nan")),
    ("RewardAssigned", "advantage", float("inf")),
    ("BatchReady", "sample_count", 0),
])
def test_counts_indices_and_scores_out_of_their_range_are_rejected(event_type, field, value):
    valid = {
        "TrajectorySegment": segment(),
        "TrajectoryFinished": TrajectoryFinished(status="completed", segment_count=1, group_size=2,
                                                 sample_index=0),
        "GradeReported": GradeReported(score=1.0, passed=True, reason="exit 0", duration_s=0.1),
        "RewardAssigned": RewardAssigned(reward=1.0, advantage=0.5, source="exact_match"),
        "BatchReady": BatchReady(batch_id="b", uri="/b.parquet", sample_count=1, group_ids=["g"],
                                 min_policy_version=0, mean_reward=0.5),
    }[event_type]
    fields = encode(make_envelope(valid, run_id="r"))
    assert decode(fields).payload == valid
    body = msgspec.msgpack.decode(fields["body"])
    body["payload"][field] = value
    with pytest.raises(EventDecodeError, match=field):
        decode({**fields, "body": msgspec.msgpack.encode(body)})


def test_every_event_class_of_the_models_is_carried_by_exactly_one_stream():
    """The types decode() knows (EVENT_TYPES) are those the streams carry: an event class no stream carries
    could never be read back, and one on two streams would mean two things."""
    assert set(STREAM_EVENTS) == set(STREAMS)
    placed = [cls for carried in STREAM_EVENTS.values() for cls in carried]
    assert sorted(cls.__name__ for cls in placed) == sorted(cls.__name__ for cls in event_classes_defined())
    assert list(EVENT_TYPES.values()) == placed


def test_the_contract_names_every_event_class():
    """events.py is where services find the contract: every event class is one of its names."""
    assert {cls.__name__ for cls in event_classes_defined()} <= set(events.__all__)
    assert all(getattr(events, name) is not None for name in events.__all__)


def test_a_policy_update_recorded_with_the_old_stale_count_still_decodes():
    update = PolicyUpdated(version=3, checkpoint_uri="/c", batch_id="b", servers=["http://s"],
                           parity_max_abs_diff=0.0, loss=0.1, trained_samples=6, dropped={"stale": 2})
    fields = encode(make_envelope(update, run_id="r"))
    body = msgspec.msgpack.decode(fields["body"])
    body["payload"]["dropped_stale"] = 2  # what runs recorded before the field was removed carry
    assert decode({**fields, "body": msgspec.msgpack.encode(body)}).payload == update


def declared_fields(source: str) -> dict[str, dict[str, str | None]]:
    """Class name -> {each field it declares: the docstring right after it, None without one}, as the source
    says (a ClassVar is no field)."""
    out: dict[str, dict[str, str | None]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        out[node.name] = {}
        for statement, following in zip(node.body, [*node.body[1:], None]):
            if not isinstance(statement, ast.AnnAssign) or not isinstance(statement.target, ast.Name) \
                    or "ClassVar" in ast.unparse(statement.annotation):
                continue
            documented = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) \
                and isinstance(following.value.value, str) and following.value.value.strip()
            out[node.name][statement.target.id] = following.value.value if documented else None
    return out


def test_the_field_docstring_check_finds_an_undocumented_field():
    source = ('class Thing(BaseModel):\n    TYPE: ClassVar[str] = "Thing"\n    model_config = ConfigDict()\n'
              '    kept: int\n    """What it means."""\n    bare: str = ""\n'
              '    blank: int = 0\n    """ """\n')
    assert declared_fields(source) == {"Thing": {"kept": "What it means.", "bare": None, "blank": None}}


def test_every_field_of_every_model_of_the_contract_has_a_docstring():
    """The schema is the contract between the services, and its source is its documentation: every field says
    what it means (and its unit or convention) right where it is declared."""
    declared = {name: fields for path in EVENT_MODULES
                for name, fields in declared_fields(path.read_text()).items()}
    models = {name: getattr(events, name) for name in declared
              if isinstance(getattr(events, name), type) and issubclass(getattr(events, name), BaseModel)}
    unseen = [f"{name}.{field}" for name, model in models.items() for field in model.model_fields
              if not any(field in declared.get(base.__name__, {}) for base in model.__mro__)]
    assert unseen == [], "fields the source read does not find declared"
    undocumented = [f"{name}.{field}" for name in models for field, doc in declared[name].items()
                    if doc is None]
    assert undocumented == []


def test_every_event_class_names_each_consumer_group_that_reads_its_stream():
    """Who reads an event is part of what it means: its class docstring names, as `group`, every consumer
    group of its stream (consumers.py), so that a group added to a stream is added to the documentation
    too."""
    docs = {node.name: ast.get_docstring(node) or "" for path in EVENT_MODULES
            for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}
    unnamed = [f"{event.__name__} ({stream}) does not name `{group}`"
               for stream, types in STREAM_EVENTS.items() for event in types
               for group in groups_reading(stream) if f"`{group}`" not in docs[event.__name__]]
    assert unnamed == []


def one_of_every_event_type() -> list[events.Event]:
    """An event of each type with every field set, none to its default."""
    e = events
    return [
        PromptIssued(sample_index=3, group_size=8, messages=[{"role": "user", "content": "2+2?"}], label="4",
                     reward_fn="numeric", sandbox_check="true", agent="react", tools=["calculator"],
                     policy_version=2,
                     metadata={"grader": {"kind": "harbor", "task": "fix-add"}, "time_budget_s": 60}),
        e.TrajectoryStarted(sample_index=3, server_url="http://a:8000"),
        e.TrajectoryTurn(turn=1, segment_index=1, offset=4, appended_ids=[1, 2, 3, 4], response_ids=[5, 6],
                         logprobs=[-0.25, -1.5], policy_version=2, policy_version_end=3, finish_reason="stop",
                         server_url="http://a:8000"),
        e.TrajectoryTool(turn=1, call_id="call_1_0", name="calculator", arguments={"expression": "2+2"},
                         ok=False, error_kind="raised", content="ZeroDivisionError"),
        segment(attempt="a1", metadata={"turns": 2, "tool_calls": [{"name": "calculator"}]}),
        e.TrajectoryFinished(status="truncated", attempt="a1", segment_count=2, response_text="4", reward=0.5,
                             artifacts={"diff": "r/diffs/x.diff"}, error="turn budget", sample_index=3,
                             group_size=8, label="4", reward_fn="numeric", sandbox_check="true",
                             grader={"kind": "swebench", "instance_id": "x-1"}),
        e.GradeReported(score=0.5, passed=False, reason="1 of 2 tests", duration_s=1.5, log_uri="r/l.log",
                        tests={"test_a": "passed", "test_b": "failed"}),
        e.GradingFailed(reason="cannot be graded: no docker", attempts=2),
        e.RewardAssigned(reward=1.0, advantage=-0.5, source="sandbox"),
        e.RolloutDropped(reason="grade did not come in 60 s", cause="grade_timeout"),
        e.BatchReady(batch_id="b-1", uri="r/batches/b-1.parquet", sample_count=2, group_ids=["g1", "g2"],
                     min_policy_version=1, mean_reward=0.25),
        e.PolicyUpdated(version=3, checkpoint_uri="r/checkpoints/v3", batch_id="b-1", servers=["http://a:8000"],
                        parity_max_abs_diff=0.01, loss=0.5, trained_samples=15, dropped={"stale": 1},
                        metrics={"train/loss": 0.5}),
        e.DeadLettered(stream="prompts", entry_id="1-0", group="agent-runner", deliveries=6, error="boom",
                       fields={"type": "PromptIssued"}),
    ]
