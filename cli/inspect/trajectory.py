"""One rollout turn by turn: its prompt, tokens coloured by logprob, tools, grade, reward and batch.

    rollstream inspect trajectory RUN ROLLOUT [--json] [--model DIR]

`load_rollout` gathers the rollout's events from the run's whole history, `rollout_document` turns
them into plain data (the --json output) and `render_rollout` renders that data. Tokens are decoded
with the model's own tokenizer (`load_decoder`); without one their ids are shown.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rich.console import Group
from rich.padding import Padding
from rich.text import Text

from rollstream.cli.inspect.connections import (
    InspectError,
    RunSource,
    _attempt_of,
    _f32,
    _open_batch_rows,
    _settings,
    decoded_history,
)
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
from rollstream.shared.runtime.storage import Storage


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


def run_model_path(storage_uri: str, run: str) -> Path | None:
    """The model the run was configured with (<storage>/<run>/config.json), else the settings' model."""
    storage = Storage(storage_uri)
    config = storage.path(run, "config.json")
    try:
        if storage.exists(config):
            return Path(json.loads(storage.read_bytes(config))["model"]["path"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    settings = _settings()
    return Path(settings.model.path) if settings is not None else None


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


def load_rollout(source: RunSource, rollout_id: str) -> RolloutView:
    """Every event of one rollout, from the run's whole history; InspectError naming a few rollouts
    that exist when it has none."""
    histories = {stream: decoded_history(source.bus, stream, source.reader)[0]
                 for stream in ("prompts", "trajectories", "grades", "rewards", "batches", "policy")}

    def mine(envelope: Envelope) -> bool:
        return envelope.rollout_id == rollout_id or envelope.event_id.startswith(f"{rollout_id}:")

    prompts = [e for e in histories["prompts"] if mine(e) and isinstance(e.payload, PromptIssued)]
    trajectory = [e for e in histories["trajectories"] if mine(e)]
    grades = [e for e in histories["grades"] if mine(e) and isinstance(e.payload, (GradeReported, GradingFailed))]
    rewards = [e for e in histories["rewards"] if mine(e) and isinstance(e.payload, RewardAssigned)]
    if not (prompts or trajectory or grades or rewards):
        known: list[str] = []
        for envelope in histories["prompts"] + histories["trajectories"]:
            if envelope.rollout_id and envelope.rollout_id not in known:
                known.append(envelope.rollout_id)
        shown = ", ".join(known[:5]) + (f" ... ({len(known)} in all)" if len(known) > 5 else "")
        raise InspectError(f"no rollout {rollout_id!r} in run {source.run!r}"
                           + (f"; rollouts there: {shown}" if known else "; the run has no rollouts"))
    group_id = next((e.group_id for e in prompts + trajectory + rewards + grades if e.group_id), None)

    attempts: dict[str, AttemptEvents] = {}
    segment_of: dict[str, int] = {}
    for envelope in trajectory:
        name = _attempt_of(envelope, rollout_id)
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

    batches = [e for e in histories["batches"]
               if isinstance(e.payload, BatchReady) and group_id is not None and group_id in e.payload.group_ids]
    batch_ids = {e.payload.batch_id for e in batches}
    policies = [e for e in histories["policy"] if isinstance(e.payload, PolicyUpdated) and e.payload.batch_id in batch_ids]
    return RolloutView(source.run, rollout_id, group_id, prompts[-1] if prompts else None, list(attempts.values()),
                       grades, rewards, batches, policies, source.storage_uri)


def _token_pieces(ids: list[int], decoder: TokenDecoder | None) -> list[str]:
    return [decoder.piece(i) for i in ids] if decoder is not None else [f"{i} " for i in ids]


def rollout_document(view: RolloutView, decoder: TokenDecoder | None) -> dict[str, Any]:
    """Everything about one rollout as plain data (the --json output, and what the render shows)."""
    return {
        "run": view.run, "rollout_id": view.rollout_id, "group_id": view.group_id,
        "tokenizer": decoder.source if decoder is not None else None,
        "prompt": _prompt_document(view.prompt) if view.prompt is not None else None,
        "attempts": [_attempt_document(attempt, decoder) for attempt in view.attempts],
        "grades": [{"event_id": g.event_id, "type": g.type, **g.payload.model_dump(mode="json")} for g in view.grades],
        "rewards": [{"event_id": r.event_id, **r.payload.model_dump(mode="json")} for r in view.rewards],
        "batches": [_batch_document(envelope, view) for envelope in view.batches],
    }


def _prompt_document(prompt: Envelope) -> dict[str, Any]:
    p: PromptIssued = prompt.payload
    return {"event_id": prompt.event_id, "sample_index": p.sample_index, "group_size": p.group_size,
            "messages": p.messages, "label": p.label, "reward_fn": p.reward_fn,
            "sandbox_check": p.sandbox_check, "agent": p.agent, "tools": list(p.tools),
            "policy_version": p.policy_version, "metadata": p.metadata}


def _attempt_document(attempt: AttemptEvents, decoder: TokenDecoder | None) -> dict[str, Any]:
    segments = [{"segment_index": s.payload.segment_index, "status": s.payload.status,
                 "tokens": len(s.payload.tokens), "response_length": s.payload.response_length,
                 "sampled_tokens": sum(s.payload.loss_mask), "turn_policy_versions": s.payload.turn_policy_versions,
                 "response_text": s.payload.response_text} for s in attempt.segments]
    finished = None
    if attempt.finished is not None:
        f: TrajectoryFinished = attempt.finished.payload
        finished = {"status": f.status, "segment_count": f.segment_count, "response_text": f.response_text,
                    "label": f.label, "reward_fn": f.reward_fn, "sandbox_check": f.sandbox_check,
                    "grader": f.grader, "artifacts": f.artifacts, "error": f.error}
    started = attempt.started.payload.server_url if attempt.started is not None else None
    return {"attempt": attempt.attempt, "server_url": started,
            "turns": [_turn_document(envelope, attempt, decoder) for envelope in attempt.turns],
            "segments": segments, "finished": finished}


def _turn_document(envelope: Envelope, attempt: AttemptEvents, decoder: TokenDecoder | None) -> dict[str, Any]:
    t: TrajectoryTurn = envelope.payload
    context = [{"id": i, "text": piece, "mask": 0, "logprob": None, "policy_version": None,
                "policy_version_end": None}
               for i, piece in zip(t.appended_ids, _token_pieces(t.appended_ids, decoder))]
    response = [{"id": i, "text": piece, "mask": 1, "logprob": _f32(lp), "policy_version": t.policy_version,
                 "policy_version_end": t.policy_version_end}
                for i, piece, lp in zip(t.response_ids, _token_pieces(t.response_ids, decoder), t.logprobs)]
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
    }


def _batch_document(envelope: Envelope, view: RolloutView) -> dict[str, Any]:
    """A batch the rollout's group went into, with the rollout's rows of its file."""
    b: BatchReady = envelope.payload
    entry: dict[str, Any] = {"batch_id": b.batch_id, "uri": b.uri, "sample_count": b.sample_count,
                             "group_ids": b.group_ids, "min_policy_version": b.min_policy_version,
                             "mean_reward": b.mean_reward, "rows": None, "rows_error": None,
                             "trained_in": [p.payload.version for p in view.policies if p.payload.batch_id == b.batch_id]}
    try:
        rows = _open_batch_rows(view.storage_uri, view.run, b.uri)
        entry["rows"] = [{"segment_index": r.segment_index, "tokens": len(r.tokens),
                          "sampled_tokens": sum(r.loss_mask), "reward": _f32(r.reward),
                          "advantage": _f32(r.advantage), "turn_policy_versions": r.turn_policy_versions}
                         for r in rows if r.rollout_id == view.rollout_id]
    except Exception as exc:  # the file is gone or unreadable: say so, show the rest
        entry["rows_error"] = f"{type(exc).__name__}: {exc}"
    return entry


LOGPROB_STYLES: tuple[tuple[float | None, str], ...] = ((-0.5, "green"), (-2.0, "yellow"), (None, "red"))
CONTEXT_STYLE = "dim"
SYNC_STYLE = "bold magenta"


def logprob_style(logprob: float) -> str:
    for bound, style in LOGPROB_STYLES:
        if bound is None or logprob >= bound:
            return style
    return LOGPROB_STYLES[-1][1]


def tokens_text(tokens: Iterable[dict[str, Any]]) -> Text:
    """Tokens as rich Text: context (mask 0) dim, sampled ones coloured by their logprob."""
    text = Text()
    for token in tokens:
        text.append(token["text"], style=CONTEXT_STYLE if not token["mask"] else logprob_style(token["logprob"]))
    return text


def logprob_legend() -> Text:
    return Text.assemble("tokens: ", ("sampled, logprob >= -0.5", "green"), "  ", ("sampled, >= -2", "yellow"), "  ",
                         ("sampled, < -2", "red"), "  ", ("context: prompt, tool results (not sampled, mask 0)", CONTEXT_STYLE))


def _shorten(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _indented(renderable: Any) -> Padding:
    return Padding(renderable, (0, 0, 0, 2), expand=False)


def render_rollout(doc: dict[str, Any]) -> Group:
    """The rollout turn by turn, from rollout_document's data."""
    out: list[Any] = [Text.assemble(("rollout ", "bold"), (doc["rollout_id"], "bold cyan"), f"  run {doc['run']}  group ",
                                    doc["group_id"] or "-"),
                      logprob_legend() if doc["tokenizer"] else
                      Text("no tokenizer: token ids shown (coloured by logprob, context dim)", style="italic")]
    out += _render_prompt(doc["prompt"])
    for attempt in doc["attempts"]:
        out += _render_attempt(attempt)
    if not doc["attempts"]:
        out.append(Text("no trajectory events", style="yellow"))
    out += [_render_grade(grade) for grade in doc["grades"]]
    for reward in doc["rewards"]:
        out.append(Text.assemble(("RewardAssigned", "bold"), f"  reward {reward['reward']}, advantage "
                                 f"{reward['advantage']}, source {reward['source']}"))
    if not doc["rewards"]:
        out.append(Text("RewardAssigned: none yet", style="yellow"))
    for batch in doc["batches"]:
        out += _render_batch(batch)
    if not doc["batches"]:
        out.append(Text("BatchReady: in no batch yet", style="yellow"))
    return Group(*out)


def _render_prompt(prompt: dict[str, Any] | None) -> list[Any]:
    if prompt is None:
        return [Text("PromptIssued: not found", style="yellow")]
    out: list[Any] = [Text.assemble(("PromptIssued", "bold"), f"  sample {prompt['sample_index']} of a group of "
                                    f"{prompt['group_size']}, label {prompt['label']!r}, reward_fn {prompt['reward_fn']}",
                                    f", sandbox check {prompt['sandbox_check']!r}" if prompt["sandbox_check"] else "",
                                    f", admitted at policy v{prompt['policy_version']}")]
    for message in prompt["messages"]:
        out.append(_indented(Text.assemble((f"{message.get('role', '?')}: ", "bold"),
                                           _shorten(str(message.get("content", "")), 2000))))
    return out


def _render_attempt(attempt: dict[str, Any]) -> list[Any]:
    label = attempt["attempt"] or "(unnamed)"
    out: list[Any] = [Text.assemble(("\nattempt ", "bold"), label, f"  server {attempt['server_url'] or '-'}")]
    for turn in attempt["turns"]:
        out += _render_turn(turn)
    for segment in attempt["segments"]:
        out.append(Text(f"segment {segment['segment_index']}: {segment['status']}, {segment['tokens']} tokens "
                        f"({segment['sampled_tokens']} sampled), turn versions {segment['turn_policy_versions']}"))
    finished = attempt["finished"]
    if finished is None:
        out.append(Text("TrajectoryFinished: not found (still running, or lost)", style="yellow"))
    else:
        out.append(Text.assemble(("TrajectoryFinished", "bold"), f"  status {finished['status']}, "
                                 f"{finished['segment_count']} segment(s)",
                                 f", error {finished['error']}" if finished["error"] else "",
                                 "\n  response_text: ", _shorten(finished["response_text"], 2000)))
    return out


def _render_turn(turn: dict[str, Any]) -> list[Any]:
    if turn["synced_mid_turn"]:
        versions = Text(f"policy v{turn['policy_version']} -> v{turn['policy_version_end']} "
                        "(weights synced mid-turn)", style=SYNC_STYLE)
    else:
        versions = Text(f"policy v{turn['policy_version']}")
    out: list[Any] = [Text.assemble((f"segment {turn['segment_index']} turn {turn['turn']}", "bold"), "  ", versions,
                                    f"  finish {turn['finish_reason']}  server {turn['server_url']}")]
    context = [t for t in turn["tokens"] if not t["mask"]]
    response = [t for t in turn["tokens"] if t["mask"]]
    if context:
        out.append(_indented(Text.assemble((f"context ({len(context)} tokens): ", "italic"), tokens_text(context))))
    out.append(_indented(Text.assemble((f"response ({len(response)} tokens): ", "italic"), tokens_text(response))))
    for tool in turn["tools"]:
        outcome = Text("ok", style="green") if tool["ok"] else Text(f"error ({tool['error_kind'] or 'unknown'})",
                                                                    style="red")
        out.append(_indented(Text.assemble(("tool ", "bold"), (tool["name"], "bold cyan"),
                                           f"({json.dumps(tool['arguments'])}) -> ", outcome, ": ",
                                           _shorten(tool["content"]))))
    return out


def _render_grade(grade: dict[str, Any]) -> Text:
    if grade["type"] == GradingFailed.TYPE:
        return Text.assemble(("GradingFailed", "bold red"), f"  the sandbox could not grade it after "
                             f"{grade['attempts']} attempt(s): {grade['reason']!r}; no reward, left out "
                             "of its group's batch")
    return Text.assemble(("GradeReported", "bold"), f"  score {grade['score']}, ",
                         ("passed", "green") if grade["passed"] else ("failed", "red"),
                         f", reason {grade['reason']!r}, {grade['duration_s']:.2f}s")


def _render_batch(batch: dict[str, Any]) -> list[Any]:
    trained = (", trained into " + ", ".join(f"v{v}" for v in batch["trained_in"])) if batch["trained_in"] else \
        ", not trained yet"
    out: list[Any] = [Text.assemble(("BatchReady", "bold"), f"  {batch['batch_id']}: {batch['sample_count']} samples, "
                                    f"min policy v{batch['min_policy_version']}, mean reward "
                                    f"{batch['mean_reward']:.4g}{trained}")]
    if batch["rows_error"]:
        out.append(_indented(Text(f"batch file unreadable: {batch['rows_error']}", style="yellow")))
    for row in batch["rows"] or []:
        out.append(_indented(Text(f"row segment {row['segment_index']}: {row['tokens']} tokens "
                                  f"({row['sampled_tokens']} sampled), reward {row['reward']}, "
                                  f"advantage {row['advantage']}")))
    return out
