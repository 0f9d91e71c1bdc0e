"""rollstream inspect: look into runs, live in Redis, trimmed, or only in their archive.

    rollstream inspect runs                          # every run in Redis and in storage, entries per stream
    rollstream inspect streams RUN                   # per stream: length, ids, archive position, groups' lag
    rollstream inspect trajectory RUN ROLLOUT [--json]   # one rollout turn by turn, tokens coloured by logprob
    rollstream inspect diff RUN_A RUN_B [--streams S]    # two runs or replays compared event by event

A run's history is read with `rollstream.shared.contract.archive.StreamHistory`: what the recorder trimmed from Redis comes
from the archive in storage, the rest from the live stream; a run that is only in storage is read from
its archive alone. Collecting (`collect_*`, `load_rollout`, `rollout_document`, `diff_runs`) is kept
apart from rendering (`*_table`, `render_*`), which returns rich renderables.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import numpy as np
import pyarrow.parquet as pq
import redis
import typer
from rich.console import Console, Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text
from rollstream.shared.contract.archive import (
    ArchiveReader,
    StreamHistory,
    archived_id,
    list_runs,
)
from rollstream.shared.contract.batches import BatchRow, read_batch
from rollstream.shared.contract.bus import STREAMS, Bus, Keys, StreamName
from rollstream.shared.contract.events import (
    BatchReady,
    Envelope,
    EventDecodeError,
    GradeReported,
    PolicyUpdated,
    PromptIssued,
    RewardAssigned,
    TrajectoryFinished,
    TrajectorySegment,
    TrajectoryStarted,
    TrajectoryTool,
    TrajectoryTurn,
    decode,
)
from rollstream.shared.runtime.storage import Storage

inspect_app = typer.Typer(add_completion=False, no_args_is_help=True,
                          help="Look into runs: live in Redis, trimmed, or only in their archive.")
err_console = Console(stderr=True)
PIPED_WIDTH = 250
"""Width of the output when it goes to a file or a pipe (and COLUMNS is unset): tables are not cut."""

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
RawEntry = tuple[str, dict]


class InspectError(Exception):
    """Something the user asked for that is not there (a run, a rollout); the message says what is."""


# -------------------------------------------------------------------------------------- connections
def _settings():
    try:
        from rollstream.shared.runtime.config import Settings

        return Settings()
    except Exception:  # a broken RS_* environment must not stop inspection
        return None


def default_redis_url() -> str:
    settings = _settings()
    return (settings.redis_url if settings is not None and settings.redis_url else None) or DEFAULT_REDIS_URL


def default_storage() -> str:
    settings = _settings()
    return settings.storage_uri if settings is not None else "runs"


def connect(url: str) -> redis.Redis | None:
    """A client, or None (with a warning) when no Redis answers there: inspection goes on from archives."""
    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        err_console.print(f"[yellow]no Redis at {url} ({exc}): reading archives only[/]")
        return None
    return client


def _text(value: bytes | str | None) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def run_in_redis(client: redis.Redis | None, run: str) -> bool:
    return client is not None and Bus(client, run).has_keys()


def run_in_archive(storage_uri: str, run: str) -> bool:
    try:
        return run in list_runs(storage_uri)
    except OSError:
        return False


def read_history(bus: Bus | None, stream: StreamName, reader: ArchiveReader | None) -> list[RawEntry]:
    """A stream's whole history, oldest first: archived entries, then live ones (StreamHistory); the
    archive alone when the run is not in Redis."""
    if bus is None:
        return [(e.entry_id, e.fields) for e in reader.entries(stream)] if reader is not None else []
    return StreamHistory(bus, stream, reader).new_entries()


def decoded_history(bus: Bus | None, stream: StreamName, reader: ArchiveReader | None) -> tuple[list[Envelope], int]:
    """The decodable events of a stream's history, and how many entries did not decode."""
    out, bad = [], 0
    for _, fields in read_history(bus, stream, reader):
        try:
            out.append(decode(fields))
        except EventDecodeError:
            bad += 1
    return out, bad


@dataclass
class RunSource:
    """Where one run is read from."""

    run: str
    storage_uri: str
    bus: Bus | None
    reader: ArchiveReader | None

    @property
    def where(self) -> str:
        return _where(self.bus is not None, self.reader is not None)


def _where(live: bool, archived: bool) -> str:
    return "both" if live and archived else "redis" if live else "archive" if archived else "-"


def open_run(client: redis.Redis | None, storage_uri: str, run: str) -> RunSource:
    """The run in Redis and/or in storage; InspectError when it is in neither."""
    try:
        Keys(run)
    except ValueError as exc:
        raise InspectError(str(exc)) from None
    live = run_in_redis(client, run)
    archived = run_in_archive(storage_uri, run)
    if not live and not archived:
        known = list_run_names(client, storage_uri)
        shown = ", ".join(known[:10]) + (f" and {len(known) - 10} more" if len(known) > 10 else "")
        raise InspectError(f"no run {run!r} in Redis or in storage {storage_uri!r}"
                           + (f"; runs: {shown}" if known else "; no runs there at all"))
    return RunSource(run, storage_uri, Bus(client, run) if live else None,
                     ArchiveReader(storage_uri, run) if archived else None)


def list_run_names(client: redis.Redis | None, storage_uri: str) -> list[str]:
    return sorted(set(redis_runs(client)) | set(_archive_runs(storage_uri)))


def redis_runs(client: redis.Redis | None) -> list[str]:
    """Run namespaces with at least one key in Redis (rs:<run>:...)."""
    if client is None:
        return []
    runs = set()
    for key in client.scan_iter(match="rs:*:*", count=1000):
        run = _text(key).split(":", 2)[1]
        try:
            Keys(run)
        except ValueError:
            continue
        runs.add(run)
    return sorted(runs)


def _archive_runs(storage_uri: str) -> list[str]:
    try:
        return list_runs(storage_uri)
    except OSError:
        return []


def archive_count(reader: ArchiveReader, stream: StreamName) -> int:
    """Distinct entries of a stream in the archive (only the entry-id column is read)."""
    ids: set[str] = set()
    for part in reader.parts(stream):
        ids.update(pq.read_table(part.path, columns=["entry_id"], filesystem=reader.storage.fs)
                   .column("entry_id").to_pylist())
    return len(ids)


# --------------------------------------------------------------------------------------------- runs
@dataclass
class RunSummary:
    run: str
    in_redis: bool
    in_archive: bool
    entries: dict[str, int]
    """Entries ever added per stream: XINFO STREAM entries-added when live, else the archive's count."""
    policy_version: int | None

    @property
    def where(self) -> str:
        return _where(self.in_redis, self.in_archive)


def latest_policy_version(bus: Bus | None, reader: ArchiveReader | None) -> int | None:
    if bus is not None:
        try:
            newest = bus.redis.xrevrange(bus.keys.stream("policy"), count=10)
        except redis.ResponseError:  # not a stream (another program's key)
            newest = []
        for _, fields in newest:
            try:
                event = decode(fields).payload
            except EventDecodeError:
                continue
            if isinstance(event, PolicyUpdated):
                return event.version
    if reader is not None and "policy" in reader.streams():
        version = None
        for entry in reader.entries("policy"):
            try:
                event = entry.envelope.payload
            except Exception:
                continue
            if isinstance(event, PolicyUpdated):
                version = event.version
        return version
    return None


def summarize_run(client: redis.Redis | None, storage_uri: str, run: str, in_redis: bool, in_archive: bool) -> RunSummary:
    bus = Bus(client, run) if in_redis and client is not None else None
    reader = ArchiveReader(storage_uri, run) if in_archive else None
    archived_streams = set(reader.streams()) if reader is not None else set()
    entries: dict[str, int] = {}
    for stream in STREAMS:
        count = None
        if bus is not None:
            try:
                info = bus.redis.xinfo_stream(bus.keys.stream(stream))
                count = int(info.get("entries-added", info["length"]))
            except redis.ResponseError:
                count = None
        if count is None and stream in archived_streams:
            count = archive_count(reader, stream)
        entries[stream] = count or 0
    return RunSummary(run, in_redis, in_archive, entries, latest_policy_version(bus, reader))


def collect_runs(client: redis.Redis | None, storage_uri: str) -> list[RunSummary]:
    """Every run in Redis or with an archive in storage, sorted by name."""
    live = set(redis_runs(client))
    archived = set(_archive_runs(storage_uri))
    return [summarize_run(client, storage_uri, run, run in live, run in archived) for run in sorted(live | archived)]


def runs_table(summaries: list[RunSummary], storage_uri: str = "") -> Table:
    table = Table(title=f"runs ({len(summaries)})" + (f", storage {storage_uri}" if storage_uri else ""))
    table.add_column("run", no_wrap=True)
    table.add_column("where")
    for stream in STREAMS:
        table.add_column(stream, justify="right")
    table.add_column("latest version", justify="right")
    for s in summaries:
        table.add_row(s.run, s.where, *(str(s.entries[stream]) for stream in STREAMS),
                      "-" if s.policy_version is None else f"v{s.policy_version}")
    table.caption = "entries ever added per stream (XINFO STREAM entries-added when live, else the archive's count)"
    return table


# ------------------------------------------------------------------------------------------ streams
@dataclass
class GroupState:
    name: str
    consumers: int
    lag: int | None
    """Entries not yet delivered to the group."""
    lag_source: str
    """`redis` (XINFO GROUPS lag) or `computed` (Bus.group_lag: Redis could not tell)."""
    pending: int
    """Delivered, not acknowledged."""
    last_delivered: str


@dataclass
class StreamState:
    stream: str
    live: bool
    length: int | None
    added: int | None
    first_id: str | None
    last_id: str | None
    archived_to: str | None
    archived_entries: int | None
    groups: list[GroupState] = field(default_factory=list)


def collect_streams(source: RunSource) -> list[StreamState]:
    bus, reader = source.bus, source.reader
    archived_streams = set(reader.streams()) if reader is not None else set()
    out = []
    for stream in STREAMS:
        state = StreamState(stream, False, None, None, None, None, None,
                            archive_count(reader, stream) if stream in archived_streams else None)
        if bus is not None:
            state.archived_to = archived_id(bus, stream)
            key = bus.keys.stream(stream)
            try:
                info = bus.redis.xinfo_stream(key)
            except redis.ResponseError:
                info = None
            if info is not None:
                state.live = True
                state.length = int(info["length"])
                state.added = int(info["entries-added"]) if info.get("entries-added") is not None else None
                first, last = info.get("first-entry"), info.get("last-entry")
                state.first_id = _text(first[0]) if first else None
                state.last_id = _text(last[0]) if last else None
                try:
                    groups = bus.redis.xinfo_groups(key)
                except redis.ResponseError:  # deleted since
                    groups = []
                for group in groups:
                    name = _text(group["name"])
                    lag, lag_source = group.get("lag"), "redis"
                    if lag is None:
                        lag, lag_source = bus.group_lag(stream, name)[0], "computed"
                    state.groups.append(GroupState(name, int(group["consumers"]), int(lag), lag_source,
                                                   int(group["pending"]), _text(group["last-delivered-id"])))
        out.append(state)
    return out


def streams_table(run: str, states: list[StreamState], where: str = "") -> Table:
    table = Table(title=f"run {run}: streams" + (f" ({where})" if where else ""))
    for column, justify in (("stream", "left"), ("length", "right"), ("added", "right"), ("first id", "left"),
                            ("last id", "left"), ("archived to", "left"), ("archived", "right"), ("group", "left"),
                            ("consumers", "right"), ("lag", "right"), ("pending", "right")):
        table.add_column(column, justify=justify, no_wrap=True)

    def show(value) -> str:
        return "-" if value is None else str(value)

    for state in states:
        stream_cells = [state.stream, show(state.length), show(state.added), show(state.first_id),
                        show(state.last_id), show(state.archived_to), show(state.archived_entries)]
        if not state.live:
            stream_cells[1] = "not live"
        if not state.groups:
            table.add_row(*stream_cells, "-", "", "", "")
        for i, group in enumerate(state.groups):
            lag = str(group.lag) + ("*" if group.lag_source == "computed" else "")
            cells = stream_cells if i == 0 else [""] * len(stream_cells)
            table.add_row(*cells, group.name, str(group.consumers), lag, str(group.pending))
        table.add_section()
    table.caption = ("lag: entries not yet delivered to the group (* counted after its last-delivered id: Redis "
                     "could not tell); pending: delivered, not acknowledged; archived: entries in the archive")
    return table


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


def _attempt_of(envelope: Envelope, rollout_id: str) -> str:
    attempt = getattr(envelope.payload, "attempt", "") or ""
    if attempt:
        return attempt
    prefix = f"{rollout_id}:"
    if envelope.event_id.startswith(prefix):
        parts = envelope.event_id[len(prefix):].split(":")
        if len(parts) >= 2:
            return parts[0]
    return ""


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
    grades = [e for e in histories["grades"] if mine(e) and isinstance(e.payload, GradeReported)]
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


def _f32(value: float) -> float:
    """A float32 logprob as its shortest decimal (-0.1, not -0.10000000149011612): the same float32."""
    return float(str(np.float32(value)))


def _token_pieces(ids: list[int], decoder: TokenDecoder | None) -> list[str]:
    return [decoder.piece(i) for i in ids] if decoder is not None else [f"{i} " for i in ids]


def _open_batch_rows(storage_uri: str, run: str, uri: str) -> list[BatchRow]:
    """A batch file's rows; a uri outside this storage (a copied storage) is looked up under it."""
    storage = Storage(storage_uri)
    path = uri
    if not storage.exists(path):
        name = uri.rsplit("/", 1)[-1]
        path = storage.path(run, "batches", name)
    return read_batch(storage, path)


def rollout_document(view: RolloutView, decoder: TokenDecoder | None) -> dict[str, Any]:
    """Everything about one rollout as plain data (the --json output, and what the render shows)."""
    doc: dict[str, Any] = {"run": view.run, "rollout_id": view.rollout_id, "group_id": view.group_id,
                           "tokenizer": decoder.source if decoder is not None else None}
    if view.prompt is not None:
        p: PromptIssued = view.prompt.payload
        doc["prompt"] = {"event_id": view.prompt.event_id, "sample_index": p.sample_index, "group_size": p.group_size,
                         "messages": p.messages, "label": p.label, "reward_fn": p.reward_fn,
                         "sandbox_check": p.sandbox_check, "agent": p.agent, "tools": list(p.tools),
                         "policy_version": p.policy_version, "metadata": p.metadata}
    else:
        doc["prompt"] = None
    attempts = []
    for attempt in view.attempts:
        turns = []
        for envelope in attempt.turns:
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
            turns.append({
                "event_id": envelope.event_id, "segment_index": t.segment_index, "turn": t.turn, "offset": t.offset,
                "policy_version": t.policy_version, "policy_version_end": t.policy_version_end,
                "synced_mid_turn": t.policy_version != t.policy_version_end, "finish_reason": t.finish_reason,
                "server_url": t.server_url,
                "context_text": decoder.text(t.appended_ids) if decoder is not None else None,
                "response_text": decoder.text(t.response_ids) if decoder is not None else None,
                "tokens": context + response, "tools": tools,
            })
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
        attempts.append({"attempt": attempt.attempt, "server_url": started, "turns": turns, "segments": segments,
                         "finished": finished})
    doc["attempts"] = attempts
    doc["grades"] = [{"event_id": g.event_id, **g.payload.model_dump(mode="json")} for g in view.grades]
    doc["rewards"] = [{"event_id": r.event_id, **r.payload.model_dump(mode="json")} for r in view.rewards]
    batches = []
    for envelope in view.batches:
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
        batches.append(entry)
    doc["batches"] = batches
    return doc


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


def render_rollout(doc: dict[str, Any]) -> Group:
    """The rollout turn by turn, from rollout_document's data."""
    out: list[Any] = [Text.assemble(("rollout ", "bold"), (doc["rollout_id"], "bold cyan"), f"  run {doc['run']}  group ",
                                    doc["group_id"] or "-"),
                      logprob_legend() if doc["tokenizer"] else
                      Text("no tokenizer: token ids shown (coloured by logprob, context dim)", style="italic")]
    prompt = doc["prompt"]
    if prompt is None:
        out.append(Text("PromptIssued: not found", style="yellow"))
    else:
        out.append(Text.assemble(("PromptIssued", "bold"), f"  sample {prompt['sample_index']} of a group of "
                                 f"{prompt['group_size']}, label {prompt['label']!r}, reward_fn {prompt['reward_fn']}",
                                 f", sandbox check {prompt['sandbox_check']!r}" if prompt["sandbox_check"] else "",
                                 f", admitted at policy v{prompt['policy_version']}"))
        for message in prompt["messages"]:
            out.append(Padding(Text.assemble((f"{message.get('role', '?')}: ", "bold"),
                                             _shorten(str(message.get("content", "")), 2000)), (0, 0, 0, 2), expand=False))
    for attempt in doc["attempts"]:
        label = attempt["attempt"] or "(unnamed)"
        out.append(Text.assemble(("\nattempt ", "bold"), label, f"  server {attempt['server_url'] or '-'}"))
        for turn in attempt["turns"]:
            if turn["synced_mid_turn"]:
                versions = Text(f"policy v{turn['policy_version']} -> v{turn['policy_version_end']} "
                                "(weights synced mid-turn)", style=SYNC_STYLE)
            else:
                versions = Text(f"policy v{turn['policy_version']}")
            out.append(Text.assemble((f"segment {turn['segment_index']} turn {turn['turn']}", "bold"), "  ", versions,
                                     f"  finish {turn['finish_reason']}  server {turn['server_url']}"))
            context = [t for t in turn["tokens"] if not t["mask"]]
            response = [t for t in turn["tokens"] if t["mask"]]
            if context:
                out.append(Padding(Text.assemble((f"context ({len(context)} tokens): ", "italic"), tokens_text(context)),
                                   (0, 0, 0, 2), expand=False))
            out.append(Padding(Text.assemble((f"response ({len(response)} tokens): ", "italic"), tokens_text(response)),
                               (0, 0, 0, 2), expand=False))
            for tool in turn["tools"]:
                outcome = Text("ok", style="green") if tool["ok"] else Text(f"error ({tool['error_kind'] or 'unknown'})",
                                                                            style="red")
                out.append(Padding(Text.assemble(("tool ", "bold"), (tool["name"], "bold cyan"),
                                                 f"({json.dumps(tool['arguments'])}) -> ", outcome, ": ",
                                                 _shorten(tool["content"])), (0, 0, 0, 2), expand=False))
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
    if not doc["attempts"]:
        out.append(Text("no trajectory events", style="yellow"))
    for grade in doc["grades"]:
        out.append(Text.assemble(("GradeReported", "bold"), f"  score {grade['score']}, ",
                                 ("passed", "green") if grade["passed"] else ("failed", "red"),
                                 f", reason {grade['reason']!r}, {grade['duration_s']:.2f}s"))
    for reward in doc["rewards"]:
        out.append(Text.assemble(("RewardAssigned", "bold"), f"  reward {reward['reward']}, advantage "
                                 f"{reward['advantage']}, source {reward['source']}"))
    if not doc["rewards"]:
        out.append(Text("RewardAssigned: none yet", style="yellow"))
    for batch in doc["batches"]:
        trained = (", trained into " + ", ".join(f"v{v}" for v in batch["trained_in"])) if batch["trained_in"] else \
            ", not trained yet"
        out.append(Text.assemble(("BatchReady", "bold"), f"  {batch['batch_id']}: {batch['sample_count']} samples, "
                                 f"min policy v{batch['min_policy_version']}, mean reward {batch['mean_reward']:.4g}{trained}"))
        if batch["rows_error"]:
            out.append(Padding(Text(f"batch file unreadable: {batch['rows_error']}", style="yellow"), (0, 0, 0, 2), expand=False))
        for row in batch["rows"] or []:
            out.append(Padding(Text(f"row segment {row['segment_index']}: {row['tokens']} tokens "
                                    f"({row['sampled_tokens']} sampled), reward {row['reward']}, "
                                    f"advantage {row['advantage']}"), (0, 0, 0, 2), expand=False))
    if not doc["batches"]:
        out.append(Text("BatchReady: in no batch yet", style="yellow"))
    return Group(*out)


# --------------------------------------------------------------------------------------------- diff
IGNORED_ENVELOPE_FIELDS = ("time", "run_id", "event_id")
MEASURED_FIELDS = ("duration_s", "metrics.*seconds*")
"""Wall-clock measurements (a grade's duration, the trainer's step and sync times): they differ between
any two executions, so diff leaves them out unless asked for --exact (fnmatch patterns on field names)."""
_MISSING = object()


class Normalizer:
    """Makes two runs' names comparable: their run ids become `{run}`, their storage roots `{storage}`,
    a rollout's attempts `attempt<k>` (k-th of that rollout), and a batch of B that holds the same
    groups as a batch of A takes A's batch id. Applied to event ids (the match key) and to values."""

    def __init__(self, runs: Iterable[str], roots: Iterable[str], enabled: bool = True) -> None:
        self.enabled = enabled
        runs = sorted({r for r in runs if r}, key=len, reverse=True)
        self.run_re = re.compile(r"(?<![A-Za-z0-9_])(?:" + "|".join(map(re.escape, runs)) + r")(?![A-Za-z0-9_])") \
            if runs else None
        self.roots = sorted({r.rstrip("/") for r in roots if r and r.rstrip("/")}, key=len, reverse=True)
        self.exact: dict[str, str] = {}
        self.exact_re: re.Pattern | None = None
        self.attempts: dict[str, str] = {}

    def with_batches(self, mapping: dict[str, str]) -> "Normalizer":
        self.exact = dict(mapping)
        self.exact_re = re.compile("|".join(map(re.escape, sorted(mapping, key=len, reverse=True)))) if mapping else None
        return self

    def text(self, value: str) -> str:
        if not self.enabled:
            return value
        if self.exact_re is not None:
            value = self.exact_re.sub(lambda m: self.exact[m[0]], value)
        for root in self.roots:
            value = value.replace(root, "{storage}")
        if self.run_re is not None:
            value = self.run_re.sub("{run}", value)
        return value

    def value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.value(k) if isinstance(k, str) else k: self.value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        return value

    def learn_attempts(self, trajectories: list[Envelope]) -> None:
        seen: dict[str, list[str]] = {}
        for envelope in trajectories:
            rollout = envelope.rollout_id
            attempt = _attempt_of(envelope, rollout) if rollout else ""
            if attempt and attempt not in self.attempts:
                names = seen.setdefault(rollout, [])
                names.append(attempt)
                self.attempts[attempt] = f"attempt{len(names) - 1}"

    def event_key(self, envelope: Envelope) -> str:
        if not self.enabled:
            return envelope.event_id
        parts = [self.attempts.get(part, part) for part in envelope.event_id.split(":")]
        return self.text(":".join(parts))

    def fields(self, envelope: Envelope) -> dict[str, Any]:
        """The envelope's compared fields, flattened: envelope.<name> for the envelope's ids, the
        payload's fields by name (nested dicts as a.b)."""
        data = envelope.model_dump(mode="json")
        payload = data.pop("payload")
        for name in IGNORED_ENVELOPE_FIELDS:
            data.pop(name, None)
        if self.enabled and isinstance(payload.get("attempt"), str):
            payload["attempt"] = self.attempts.get(payload["attempt"], payload["attempt"])
        out = {f"envelope.{k}": self.value(v) for k, v in data.items()}
        out.update(_flatten(self.value(payload)))
        return out


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and (value or not prefix):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def show_value(value: Any, limit: int = 60) -> str:
    if value is _MISSING:
        return "(absent)"
    if isinstance(value, float):
        text = repr(value)
    elif isinstance(value, str):
        text = json.dumps(value)
    elif isinstance(value, list) and len(value) > 8:
        text = f"[{len(value)} items]"
    else:
        text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def show_change(name: str, a: Any, b: Any) -> str:
    """`name a -> b`; for long lists, where they first differ."""
    if isinstance(a, list) and isinstance(b, list) and (len(a) > 8 or len(b) > 8):
        differing = [i for i in range(min(len(a), len(b))) if a[i] != b[i]]
        detail = []
        if len(a) != len(b):
            detail.append(f"{len(a)} -> {len(b)} items")
        if differing:
            i = differing[0]
            detail.append(f"[{i}] {show_value(a[i])} -> {show_value(b[i])} ({len(differing)} of "
                          f"{min(len(a), len(b))} positions differ)")
        return f"{name}: " + ", ".join(detail)
    return f"{name} {show_value(a)} -> {show_value(b)}"


@dataclass
class FieldChange:
    name: str
    a: Any
    b: Any

    def __str__(self) -> str:
        return show_change(self.name, self.a, self.b)


@dataclass
class RowsDiff:
    """A batch's file compared row by row, rows keyed by (rollout id, segment index)."""

    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    changed: list[tuple[str, list[FieldChange]]] = field(default_factory=list)
    error: str | None = None

    @property
    def differs(self) -> bool:
        return bool(self.only_a or self.only_b or self.changed)


@dataclass
class EventDiff:
    key: str
    """A's event id (B's where only B has it)."""
    changes: list[FieldChange] = field(default_factory=list)
    rows: RowsDiff | None = None


@dataclass
class StreamDiff:
    stream: str
    identical: int = 0
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    different: list[EventDiff] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def differs(self) -> bool:
        return bool(self.only_a or self.only_b or self.different)


@dataclass
class DiffReport:
    a: str
    b: str
    streams: list[StreamDiff]
    events: tuple[int, int]

    @property
    def identical(self) -> bool:
        return not any(s.differs for s in self.streams)


@dataclass
class SideEvents:
    source: RunSource
    label: str
    events: dict[str, list[Envelope]]
    undecodable: dict[str, int]


def read_side(source: RunSource, streams: Iterable[StreamName], label: str) -> SideEvents:
    events, bad = {}, {}
    for stream in streams:
        events[stream], bad[stream] = decoded_history(source.bus, stream, source.reader)
    return SideEvents(source, label, events, bad)


def _batch_groups(side: SideEvents, normalizer: Normalizer) -> dict[tuple[str, ...], str]:
    out = {}
    for envelope in side.events.get("batches", []):
        if isinstance(envelope.payload, BatchReady):
            out.setdefault(tuple(normalizer.text(g) for g in envelope.payload.group_ids), envelope.payload.batch_id)
    return out


def _row_key(row: BatchRow, normalizer: Normalizer) -> tuple[str, int]:
    return normalizer.text(row.rollout_id), row.segment_index


def _row_fields(row: BatchRow, normalizer: Normalizer) -> dict[str, Any]:
    data = asdict(row)
    data["reward"], data["advantage"] = _f32(row.reward), _f32(row.advantage)  # float32 columns, shown as such
    data["rollout_logprobs"] = [_f32(x) for x in row.rollout_logprobs]
    return {k: normalizer.value(v) if isinstance(v, (str, dict, list)) else v for k, v in data.items()}


def compare_batch_rows(a: SideEvents, b: SideEvents, event_a: BatchReady, event_b: BatchReady,
                       na: Normalizer, nb: Normalizer) -> RowsDiff:
    diff = RowsDiff()
    rows = []
    for side, event in ((a, event_a), (b, event_b)):
        try:
            rows.append(_open_batch_rows(side.source.storage_uri, side.source.run, event.uri))
        except Exception as exc:
            rows.append(exc)
    if isinstance(rows[0], Exception) or isinstance(rows[1], Exception):
        problems = [f"{side.label}: {type(r).__name__}: {r}" for side, r in zip((a, b), rows) if isinstance(r, Exception)]
        diff.error = "; ".join(problems)
        if len(problems) == 1:  # one file there, the other not: they differ
            missing = diff.only_a if isinstance(rows[1], Exception) else diff.only_b
            missing.append("(the whole file: the other side's cannot be read)")
        return diff
    keyed_a = {_row_key(r, na): r for r in rows[0]}
    keyed_b = {_row_key(r, nb): r for r in rows[1]}
    for key, row in keyed_a.items():
        shown = f"({row.rollout_id}, {row.segment_index})"
        if key not in keyed_b:
            diff.only_a.append(shown)
            continue
        fa, fb = _row_fields(row, na), _row_fields(keyed_b[key], nb)
        changes = [FieldChange(name, fa[name], fb[name]) for name in fa if fa[name] != fb[name]]
        if changes:
            diff.changed.append((shown, changes))
    diff.only_b.extend(f"({r.rollout_id}, {r.segment_index})" for key, r in keyed_b.items() if key not in keyed_a)
    return diff


def compare_stream(stream: str, a: SideEvents, b: SideEvents, na: Normalizer, nb: Normalizer,
                   ignore: tuple[str, ...] = MEASURED_FIELDS) -> StreamDiff:
    def keyed(events: list[Envelope], normalizer: Normalizer) -> dict[str, Envelope]:
        out: dict[str, Envelope] = {}
        seen: Counter = Counter()
        for envelope in events:
            key = normalizer.event_key(envelope)
            seen[key] += 1
            out[key if seen[key] == 1 else f"{key}#{seen[key]}"] = envelope
        return out

    result = StreamDiff(stream)
    for side in (a, b):
        if side.undecodable.get(stream):
            result.notes.append(f"{side.label}: {side.undecodable[stream]} entries do not decode (not compared)")
    events_a, events_b = keyed(a.events[stream], na), keyed(b.events[stream], nb)
    for key, env_a in events_a.items():
        env_b = events_b.get(key)
        if env_b is None:
            result.only_a.append(env_a.event_id)
            continue
        fa, fb = na.fields(env_a), nb.fields(env_b)
        changes = [FieldChange(name, fa.get(name, _MISSING), fb.get(name, _MISSING))
                   for name in list(fa) + [n for n in fb if n not in fa]
                   if fa.get(name, _MISSING) != fb.get(name, _MISSING)
                   and not any(fnmatch.fnmatchcase(name, pattern) for pattern in ignore)]
        rows = None
        if isinstance(env_a.payload, BatchReady) and isinstance(env_b.payload, BatchReady):
            rows = compare_batch_rows(a, b, env_a.payload, env_b.payload, na, nb)
            if rows.error and not rows.differs:
                result.notes.append(f"batch {env_a.payload.batch_id}: rows not compared ({rows.error})")
        if changes or (rows is not None and rows.differs):
            result.different.append(EventDiff(env_a.event_id, changes, rows))
        else:
            result.identical += 1
    result.only_b.extend(env.event_id for key, env in events_b.items() if key not in events_a)
    return result


def diff_runs(a: RunSource, b: RunSource, streams: Iterable[StreamName] = STREAMS, normalize: bool = True,
              label_a: str | None = None, label_b: str | None = None,
              ignore: tuple[str, ...] = MEASURED_FIELDS) -> DiffReport:
    """Compare two runs' histories event by event, matched by event id (see Normalizer)."""
    streams = list(streams)
    wanted = list(dict.fromkeys([*streams, *(["batches"] if normalize and "policy" in streams else [])]))
    side_a = read_side(a, wanted, label_a or f"A ({a.run})")
    side_b = read_side(b, wanted, label_b or f"B ({b.run})")
    runs = [a.run, b.run]
    roots = [Storage(a.storage_uri).root, Storage(b.storage_uri).root]
    na, nb = Normalizer(runs, roots, normalize), Normalizer(runs, roots, normalize)
    if normalize:
        na.learn_attempts(side_a.events.get("trajectories", []))
        nb.learn_attempts(side_b.events.get("trajectories", []))
        groups_a = _batch_groups(side_a, na)
        ids_a = set(groups_a.values())
        mapping = {batch: groups_a[groups] for groups, batch in _batch_groups(side_b, nb).items()
                   if groups in groups_a and batch not in ids_a and groups_a[groups] != batch}
        nb.with_batches(mapping)
    results = [compare_stream(stream, side_a, side_b, na, nb, ignore) for stream in streams]
    counts = (sum(len(side_a.events[s]) for s in streams), sum(len(side_b.events[s]) for s in streams))
    return DiffReport(side_a.label, side_b.label, results, counts)


def render_diff(report: DiffReport, limit: int = 10) -> Group:
    table = Table(title=f"diff: {report.a} vs {report.b}")
    for column in ("stream", "identical", "only in A", "only in B", "different"):
        table.add_column(column, justify="left" if column == "stream" else "right")
    for s in report.streams:
        style = "red" if s.differs else None
        table.add_row(s.stream, str(s.identical), str(len(s.only_a)), str(len(s.only_b)), str(len(s.different)),
                      style=style)
    out: list[Any] = [table]
    for s in report.streams:
        for note in s.notes:
            out.append(Text(f"{s.stream}: note: {note}", style="yellow"))
        for event in s.different[:limit]:
            line = f"{s.stream} {event.key}: " + (", ".join(map(str, event.changes)) if event.changes else "event identical")
            out.append(Text(line))
            if event.rows is not None and event.rows.differs:
                rows = event.rows
                for shown, changes in rows.changed[:limit]:
                    out.append(Text(f"    row {shown}: " + ", ".join(map(str, changes))))
                if len(rows.changed) > limit:
                    out.append(Text(f"    ... {len(rows.changed) - limit} more rows differ"))
                for name, missing in (("A", rows.only_a), ("B", rows.only_b)):
                    if missing:
                        out.append(Text(f"    rows only in {name}: " + ", ".join(missing[:limit])
                                        + (f" ... ({len(missing)})" if len(missing) > limit else "")))
        if len(s.different) > limit:
            out.append(Text(f"{s.stream}: ... {len(s.different) - limit} more events differ"))
        for name, missing in (("A", s.only_a), ("B", s.only_b)):
            if missing:
                out.append(Text(f"{s.stream} only in {name}: " + ", ".join(missing[:limit])
                                + (f" ... ({len(missing)} in all)" if len(missing) > limit else "")))
    out.append(diff_verdict(report))
    return Group(*out)


def diff_verdict(report: DiffReport) -> Text:
    names = ", ".join(s.stream for s in report.streams)
    if report.identical:
        return Text(f"identical: {report.a} and {report.b} have the same events on {names} "
                    f"({report.events[0]} events)", style="bold green")
    differing = [s for s in report.streams if s.differs]
    parts = []
    for s in differing:
        counts = [(len(s.different), "different"), (len(s.only_a), "only in A"), (len(s.only_b), "only in B")]
        parts.append(f"{s.stream} (" + ", ".join(f"{n} {what}" for n, what in counts if n) + ")")
    return Text(f"different: {report.a} and {report.b} differ on {len(differing)} of {len(report.streams)} "
                f"streams: " + "; ".join(parts), style="bold red")


# ------------------------------------------------------------------------------------------ commands
RedisUrl = Annotated[Optional[str], typer.Option("--redis-url", help="Redis of the runs (default: RS_REDIS_URL, "
                                                 f"else {DEFAULT_REDIS_URL}).")]
StorageOpt = Annotated[Optional[str], typer.Option("--storage", help="Run storage holding the archives "
                                                   "(default: RS_STORAGE_URI, else runs).")]


def out_console() -> Console:
    """The commands' console: the terminal's width, or wide when piped so that ids are not cut."""
    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(width=PIPED_WIDTH)
    return console


def _fail(message: str, code: int = 1) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


@inspect_app.command("runs")
def runs_command(redis_url: RedisUrl = None, storage: StorageOpt = None) -> None:
    """List runs in Redis and in storage: where each is, entries per stream, latest policy version."""
    storage = storage or default_storage()
    client = connect(redis_url or default_redis_url())
    out_console().print(runs_table(collect_runs(client, storage), storage))


@inspect_app.command("streams")
def streams_command(run: Annotated[str, typer.Argument(help="Run id.")], redis_url: RedisUrl = None,
                    storage: StorageOpt = None) -> None:
    """Per stream of a run: length, entries added, ids, archive position, groups' lag and pending.

    Lag: entries not yet delivered to the group; pending: delivered, not acknowledged. Unknown run: exit 1."""
    storage = storage or default_storage()
    client = connect(redis_url or default_redis_url())
    try:
        source = open_run(client, storage, run)
    except InspectError as exc:
        _fail(str(exc))
    out_console().print(streams_table(run, collect_streams(source), source.where))


@inspect_app.command("trajectory")
def trajectory_command(
    run: Annotated[str, typer.Argument(help="Run id.")],
    rollout_id: Annotated[str, typer.Argument(help="Rollout id (envelope rollout_id).")],
    model: Annotated[Optional[Path], typer.Option(help="Model directory whose tokenizer decodes the tokens "
                                                  "(default: the run's config.json model, else RS_MODEL__PATH).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead.")] = False,
    redis_url: RedisUrl = None,
    storage: StorageOpt = None,
) -> None:
    """One rollout turn by turn, its tokens coloured by logprob, reward and batch.

    The prompt; every turn's context (dim, not sampled) and sampled tokens coloured by logprob, its policy
    versions (a sync mid-turn highlighted) and tool calls; the finish, grade, reward and advantage; the batch
    that took it and the version it trained. Read from Redis and the archive. Unknown rollout: exit 1."""
    storage = storage or default_storage()
    client = connect(redis_url or default_redis_url())
    try:
        view = load_rollout(open_run(client, storage, run), rollout_id)
    except InspectError as exc:
        _fail(str(exc))
    path = model or run_model_path(storage, run)
    decoder, why = load_decoder(path)
    if decoder is None:
        err_console.print(f"[yellow]no tokenizer ({path}: {why}): token ids shown[/]", highlight=False)
    doc = rollout_document(view, decoder)
    if as_json:
        print(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        out_console().print(render_rollout(doc))


@inspect_app.command("diff")
def diff_command(
    run_a: Annotated[str, typer.Argument(help="Run A.")],
    run_b: Annotated[str, typer.Argument(help="Run B (a replay, or another run).")],
    streams: Annotated[Optional[list[str]], typer.Option("--streams", help="Streams to compare (repeat, or "
                                                         "comma-separated; default: all).")] = None,
    limit: Annotated[int, typer.Option(help="Events (and batch rows) listed per stream.")] = 10,
    normalize: Annotated[bool, typer.Option(help="Match across runs: run ids, storage roots, attempt ids and "
                                            "batch ids of the same groups are made alike.")] = True,
    exact: Annotated[bool, typer.Option(help="Compare wall-clock measurements too (" + ", ".join(MEASURED_FIELDS)
                                        + "); by default they are left out.")] = False,
    redis_url: RedisUrl = None,
    storage: StorageOpt = None,
    redis_url_b: Annotated[Optional[str], typer.Option(help="Redis of run B (default: --redis-url).")] = None,
    storage_b: Annotated[Optional[str], typer.Option(help="Storage of run B (default: --storage).")] = None,
) -> None:
    """Compare two runs (or a run and its replay) event by event; exit 0 identical, 1 different.

    Events are matched by event id, time and run id ignored; batch files are compared row by row, keyed by
    (rollout id, segment index). Exit 2: a run or stream that is not there."""
    selected: list[str] = []
    for item in streams or list(STREAMS):
        selected.extend(s.strip() for s in item.split(",") if s.strip())
    unknown = [s for s in selected if s not in STREAMS]
    if unknown:
        _fail(f"unknown stream(s) {', '.join(unknown)}; streams are {', '.join(STREAMS)}", 2)
    storage = storage or default_storage()
    url = redis_url or default_redis_url()
    client_a = connect(url)
    client_b = connect(redis_url_b) if redis_url_b and redis_url_b != url else client_a
    try:
        source_a = open_run(client_a, storage, run_a)
        source_b = open_run(client_b, storage_b or storage, run_b)
    except InspectError as exc:
        _fail(str(exc), 2)
    report = diff_runs(source_a, source_b, list(dict.fromkeys(selected)), normalize=normalize,
                       ignore=() if exact else MEASURED_FIELDS)
    out_console().print(render_diff(report, limit))
    raise typer.Exit(0 if report.identical else 1)
