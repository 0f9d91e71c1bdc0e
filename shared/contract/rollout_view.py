"""One rollout as plain data: its prompt, every attempt's turns token by token (id, text, loss mask, logprob,
policy version), tool calls and results, segments, finish, grades, rewards and the batches that took it.

Every segment, turn and batch row names its role (the run's default role's name where the segment names
none); a turn's policy version is its role's. `roles_shown` says whether the roles are worth showing: the
rollout's segments are of several roles, or of one that is not the run's default.

`load_rollout` gathers the rollout's events from the run's whole history (Redis and the archive),
`rollout_document` turns them into plain data: what `rollstream inspect trajectory --json` prints and the
console's inspector shows. Tokens are decoded with the model's own tokenizer (`load_decoder`); without one
their ids stand for them.

    python -m pytest tests/unit/cli/test_inspect.py tests/unit/services/console -q
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollstream.shared.contract.batches import TrainerLogprobs
from rollstream.shared.contract.events import (
    BatchReady,
    Envelope,
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
from rollstream.shared.contract.run_source import (
    RunSource,
    attempt_of,
    decoded_history,
    float32_value,
    open_batch_rows,
    open_trainer_logprobs,
)
from rollstream.shared.errors import RunDataNotFound
from rollstream.shared.runtime.sections.roles import RolesSettings
from rollstream.shared.runtime.storage import Storage

UNNAMED_DEFAULT_ROLE = "default"
"""What the default role is called where the run's settings are not at hand."""


# -------------------------------------------------------------------------------------- tokenizers
class TokenDecoder:
    """Token ids to text, token by token, with the model's own tokenizer."""

    def __init__(self, source: str, decode_ids: Callable[[list[int]], str]) -> None:
        self.source = source
        self._decode = decode_ids
        self._pieces: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        if token_id not in self._pieces:
            self._pieces[token_id] = self._decode([token_id])
        return self._pieces[token_id]

    def text(self, ids: list[int]) -> str:
        return self._decode(list(ids))


def load_decoder(path: str | Path | None) -> tuple[TokenDecoder | None, str | None]:
    """The tokenizer of a model directory (tokenizer.json read directly, else transformers'
    AutoTokenizer); (None, why) when there is none."""
    if path is None:
        return None, "no model path"
    path = Path(path)
    try:
        if (path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            return TokenDecoder(str(path), lambda ids: tokenizer.decode(ids, skip_special_tokens=False)), None
        from transformers import AutoTokenizer

        auto = AutoTokenizer.from_pretrained(str(path))
        return TokenDecoder(str(path), lambda ids: auto.decode(ids, skip_special_tokens=False,
                                                               clean_up_tokenization_spaces=False)), None
    except Exception as exc:  # no tokenizer there: ids are shown instead
        return None, f"{type(exc).__name__}: {exc}"


def _run_config(storage_uri: str, run: str) -> dict[str, Any] | None:
    """The settings the run was started with (<storage>/<run>/config.json, written by the local run), or None
    when it has none or it does not parse."""
    storage = Storage(storage_uri)
    config = storage.path(run, "config.json")
    try:
        if storage.exists(config):
            loaded = json.loads(storage.read_bytes(config))
            return loaded if isinstance(loaded, dict) else None
    except (OSError, ValueError):
        pass
    return None


def run_model_path(storage_uri: str, run: str, default: Path | None) -> Path | None:
    """The model the run was configured with (<storage>/<run>/config.json), else `default`."""
    try:
        return Path((_run_config(storage_uri, run) or {})["model"]["path"])
    except (KeyError, TypeError):
        return default


def run_default_role(storage_uri: str, run: str) -> str | None:
    """The default role of the run as configured (<storage>/<run>/config.json's roles), else None."""
    roles = (_run_config(storage_uri, run) or {}).get("roles")
    if roles is None:
        return None
    try:
        return RolesSettings.model_validate(roles).default_role
    except ValueError:  # a config of another version of the settings: the role stays unnamed
        return None


# --------------------------------------------------------------------------------------- trajectory
@dataclass
class AttemptEvents:
    attempt: str
    started: Envelope | None = None
    turns: list[Envelope] = field(default_factory=list)
    tools: list[tuple[int, Envelope]] = field(default_factory=list)
    """(segment index, TrajectoryTool event)."""
    segments: list[Envelope] = field(default_factory=list)
    finished: Envelope | None = None


@dataclass
class RolloutView:
    run: str
    rollout_id: str
    group_id: str | None
    prompt: Envelope | None
    attempts: list[AttemptEvents]
    grades: list[Envelope]
    rewards: list[Envelope]
    batches: list[Envelope]
    policies: list[Envelope]
    """PolicyUpdated events that trained one of the batches."""
    storage_uri: str


_TOOL_SEGMENT = re.compile(r":tool:(\d+):")
HISTORY_STREAMS = ("prompts", "trajectories", "grades", "rewards", "batches", "policy")


def load_rollout(source: RunSource, rollout_id: str) -> RolloutView:
    """Every event of one rollout, from the run's whole history; RunDataNotFound naming a few rollouts
    that exist when it has none."""
    histories = {stream: decoded_history(source.bus, stream, source.reader)[0] for stream in HISTORY_STREAMS}

    def mine(envelope: Envelope) -> bool:
        return envelope.rollout_id == rollout_id or envelope.event_id.startswith(f"{rollout_id}:")

    prompts = [e for e in histories["prompts"] if mine(e) and isinstance(e.payload, PromptIssued)]
    trajectory = [e for e in histories["trajectories"] if mine(e)]
    grades = [e for e in histories["grades"]
              if mine(e) and isinstance(e.payload, (GradeReported, GradingFailed))]
    rewards = [e for e in histories["rewards"] if mine(e) and isinstance(e.payload, RewardAssigned)]
    if not (prompts or trajectory or grades or rewards):
        known: list[str] = []
        for envelope in histories["prompts"] + histories["trajectories"]:
            if envelope.rollout_id and envelope.rollout_id not in known:
                known.append(envelope.rollout_id)
        shown = ", ".join(known[:5]) + (f" ... ({len(known)} in all)" if len(known) > 5 else "")
        raise RunDataNotFound(f"no rollout {rollout_id!r} in run {source.run!r}"
                              + (f"; rollouts there: {shown}" if known else "; the run has no rollouts"))
    group_id = next((e.group_id for e in prompts + trajectory + rewards + grades if e.group_id), None)
    batches = [e for e in histories["batches"] if isinstance(e.payload, BatchReady)
               and group_id is not None and group_id in e.payload.group_ids]
    batch_ids = {e.payload.batch_id for e in batches}
    policies = [e for e in histories["policy"]
                if isinstance(e.payload, PolicyUpdated) and e.payload.batch_id in batch_ids]
    return RolloutView(source.run, rollout_id, group_id, prompts[-1] if prompts else None,
                       _attempts(trajectory, rollout_id), grades, rewards, batches, policies,
                       source.storage_uri)


def _attempts(trajectory: list[Envelope], rollout_id: str) -> list[AttemptEvents]:
    """The rollout's trajectory events by attempt, turns in order."""
    attempts: dict[str, AttemptEvents] = {}
    segment_of: dict[str, int] = {}
    for envelope in trajectory:
        name = attempt_of(envelope, rollout_id)
        attempt = attempts.setdefault(name, AttemptEvents(name))
        event = envelope.payload
        if isinstance(event, TrajectoryStarted):
            attempt.started = envelope
        elif isinstance(event, TrajectoryTurn):
            attempt.turns.append(envelope)
            segment_of[name] = event.segment_index
        elif isinstance(event, TrajectoryTool):
            match = _TOOL_SEGMENT.search(envelope.event_id)
            attempt.tools.append((int(match[1]) if match else segment_of.get(name, 0), envelope))
        elif isinstance(event, TrajectorySegment):
            attempt.segments.append(envelope)
        elif isinstance(event, TrajectoryFinished):
            attempt.finished = envelope
    for attempt in attempts.values():
        attempt.turns.sort(key=lambda e: (e.payload.segment_index, e.payload.turn))
    return list(attempts.values())


def _token_pieces(ids: list[int], decoder: TokenDecoder | None) -> list[str]:
    return [decoder.piece(i) for i in ids] if decoder is not None else [f"{i} " for i in ids]


def rollout_document(view: RolloutView, decoder: TokenDecoder | None,
                     default_role: str | None = None) -> dict[str, Any]:
    """Everything about one rollout as plain data (the --json output, and what the render shows).
    default_role: the run's (roles.default), which a segment naming no role belongs to; None when the run's
    settings are not at hand (it is then called UNNAMED_DEFAULT_ROLE)."""
    default = default_role or UNNAMED_DEFAULT_ROLE
    trained = _trained(view)
    roles = list(dict.fromkeys(segment.payload.role or default
                               for attempt in view.attempts for segment in attempt.segments))
    return {
        "run": view.run, "rollout_id": view.rollout_id, "group_id": view.group_id,
        "tokenizer": decoder.source if decoder is not None else None,
        "default_role": default, "roles": roles,
        "roles_shown": len(roles) > 1 or roles not in ([], [default]),
        "prompt": _prompt_document(view.prompt) if view.prompt is not None else None,
        "attempts": [_attempt_document(attempt, decoder, trained, default) for attempt in view.attempts],
        "grades": [{"event_id": g.event_id, "type": g.type, **g.payload.model_dump(mode="json")}
                   for g in view.grades],
        "rewards": [{"event_id": r.event_id, **r.payload.model_dump(mode="json")} for r in view.rewards],
        "batches": [_batch_document(envelope, view, default) for envelope in view.batches],
    }


def _prompt_document(prompt: Envelope) -> dict[str, Any]:
    p: PromptIssued = prompt.payload
    return {"event_id": prompt.event_id, "sample_index": p.sample_index, "group_size": p.group_size,
            "messages": p.messages, "label": p.label, "reward_fn": p.reward_fn,
            "sandbox_check": p.sandbox_check, "agent": p.agent, "tools": list(p.tools),
            "policy_version": p.policy_version, "metadata": p.metadata, "role": p.role}


def _trained(view: RolloutView) -> dict[tuple[int, ...], TrainerLogprobs]:
    """The trainer's logprobs of the rollout's trained segments, by the segment's tokens (an attempt that was
    not the one trained has other tokens)."""
    out = {}
    for envelope in view.batches:
        batch: BatchReady = envelope.payload
        try:
            written = open_trainer_logprobs(view.storage_uri, view.run, batch.uri)
            rows = open_batch_rows(view.storage_uri, view.run, batch.uri) if written else []
        except (OSError, ValueError):  # unreadable: the batch's own entry says what is wrong with its files
            continue
        mine = {(t.rollout_id, t.segment_index): t for t in written or []}
        out.update((tuple(row.tokens), mine[(row.rollout_id, row.segment_index)]) for row in rows
                   if (row.rollout_id, row.segment_index) in mine and row.rollout_id == view.rollout_id)
    return out


def _attempt_document(attempt: AttemptEvents, decoder: TokenDecoder | None,
                      trained: dict[tuple[int, ...], TrainerLogprobs], default_role: str) -> dict[str, Any]:
    segments = [{"segment_index": s.payload.segment_index, "role": s.payload.role or default_role,
                 "status": s.payload.status, "tokens": len(s.payload.tokens),
                 "response_length": s.payload.response_length, "sampled_tokens": sum(s.payload.loss_mask),
                 "turn_policy_versions": s.payload.turn_policy_versions,
                 "response_text": s.payload.response_text, "session_id": s.session_id,
                 "metadata": s.payload.metadata, "shared_prefix": _shared_prefix(s, attempt.segments)}
                for s in attempt.segments]
    # a turn's role is its segment's; None while the segment is not published yet (the rollout runs)
    role_of = {segment["segment_index"]: segment["role"] for segment in segments}
    trainer_of = {s.payload.segment_index: trained[tuple(s.payload.tokens)] for s in attempt.segments
                  if tuple(s.payload.tokens) in trained}
    finished = None
    if attempt.finished is not None:
        f: TrajectoryFinished = attempt.finished.payload
        finished = {"status": f.status, "segment_count": f.segment_count, "response_text": f.response_text,
                    "label": f.label, "reward_fn": f.reward_fn, "sandbox_check": f.sandbox_check,
                    "grader": f.grader, "artifacts": f.artifacts, "error": f.error,
                    "needs_grade": f.needs_grade}
    started = attempt.started.payload.server_url if attempt.started is not None else None
    turns = []
    for turn in attempt.turns:
        index = turn.payload.segment_index
        turns.append({**_turn_document(turn, attempt, decoder, trainer_of.get(index)),
                      "role": role_of.get(index)})
    return {"attempt": attempt.attempt, "server_url": started, "turns": turns, "segments": segments,
            "finished": finished}


def _shared_prefix(segment: Envelope, segments: list[Envelope]) -> dict[str, int] | None:
    """The earlier segment of the attempt this one shares the longest start with, and how many tokens: where a
    gateway session's conversation forked (an edit, a branch), or the prompt a sub-agent's shares; None when
    it shares no token with any."""
    tokens = segment.payload.tokens
    best: dict[str, int] | None = None
    for other in segments:
        if other.payload.segment_index >= segment.payload.segment_index:
            continue
        shared = 0
        for mine, theirs in zip(tokens, other.payload.tokens):
            if mine != theirs:
                break
            shared += 1
        if shared and (best is None or shared > best["tokens"]):
            best = {"segment_index": other.payload.segment_index, "tokens": shared}
    return best


def _turn_document(envelope: Envelope, attempt: AttemptEvents, decoder: TokenDecoder | None,
                   trainer: TrainerLogprobs | None) -> dict[str, Any]:
    """One turn token by token; with `trainer`, each sampled token's logprob as the trainer computed it."""
    t: TrajectoryTurn = envelope.payload
    context = [{"id": i, "text": piece, "mask": 0, "logprob": None, "policy_version": None,
                "policy_version_end": None, "trainer_logprob": None}
               for i, piece in zip(t.appended_ids, _token_pieces(t.appended_ids, decoder))]
    theirs = trainer.logprobs[t.offset:t.offset + len(t.response_ids)] if trainer is not None else []
    response = [{"id": i, "text": piece, "mask": 1, "logprob": float32_value(lp),
                 "policy_version": t.policy_version, "policy_version_end": t.policy_version_end,
                 "trainer_logprob": float32_value(theirs[k]) if k < len(theirs) else None}
                for k, (i, piece, lp) in enumerate(zip(t.response_ids, _token_pieces(t.response_ids, decoder),
                                                       t.logprobs))]
    tools = [{"call_id": tool.payload.call_id, "name": tool.payload.name, "arguments": tool.payload.arguments,
              "ok": tool.payload.ok, "error_kind": tool.payload.error_kind, "content": tool.payload.content}
             for segment, tool in attempt.tools if segment == t.segment_index and tool.payload.turn == t.turn]
    return {
        "event_id": envelope.event_id, "segment_index": t.segment_index, "turn": t.turn, "offset": t.offset,
        "policy_version": t.policy_version, "policy_version_end": t.policy_version_end,
        "synced_mid_turn": t.policy_version != t.policy_version_end, "finish_reason": t.finish_reason,
        "server_url": t.server_url,
        "context_text": decoder.text(t.appended_ids) if decoder is not None else None,
        "response_text": decoder.text(t.response_ids) if decoder is not None else None,
        "tokens": context + response, "tools": tools,
        "trainer_policy_version": trainer.policy_version if trainer is not None else None,
    }


def _batch_document(envelope: Envelope, view: RolloutView, default_role: str) -> dict[str, Any]:
    """A batch the rollout's group went into, with the rollout's rows of its file."""
    b: BatchReady = envelope.payload
    policies = [p.payload for p in view.policies if p.payload.batch_id == b.batch_id]
    entry: dict[str, Any] = {"batch_id": b.batch_id, "uri": b.uri, "sample_count": b.sample_count,
                             "group_ids": b.group_ids, "min_policy_version": b.min_policy_version,
                             "mean_reward": b.mean_reward, "rows": None, "rows_error": None,
                             "trained_in": [p.version for p in policies],
                             "policies": [{"version": p.version, "role_versions": dict(p.role_versions)}
                                          for p in policies]}
    try:
        rows = open_batch_rows(view.storage_uri, view.run, b.uri)
        entry["rows"] = [{"segment_index": r.segment_index, "role": r.role or default_role,
                          "tokens": len(r.tokens), "sampled_tokens": sum(r.loss_mask),
                          "reward": float32_value(r.reward),
                          "advantage": float32_value(r.advantage),
                          "turn_policy_versions": r.turn_policy_versions}
                         for r in rows if r.rollout_id == view.rollout_id]
    except Exception as exc:  # the file is gone or unreadable: say so, show the rest
        entry["rows_error"] = f"{type(exc).__name__}: {exc}"
    return entry
