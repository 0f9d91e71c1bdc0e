"""Two runs (or a run and its replay) compared event by event, and their batch files row by row.

    rollstream inspect diff RUN_A RUN_B [--streams S] [--exact] [--no-normalize]

Events are matched by event id once `Normalizer` has made the two runs' names alike (run ids, storage
roots, attempt ids, batch ids of the same groups); wall-clock measurements (`MEASURED_FIELDS`) are
left out unless --exact. `diff_runs` collects a `DiffReport`, `render_diff` renders it.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from rollstream.shared.contract.batches import BatchRow
from rollstream.shared.contract.bus import STREAMS, StreamName
from rollstream.shared.contract.events import BatchReady, Envelope
from rollstream.shared.contract.run_source import (
    RunSource,
    attempt_of,
    decoded_history,
    float32_value,
    open_batch_rows,
)
from rollstream.shared.runtime.storage import Storage

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
        self.run_re = (re.compile(r"(?<![A-Za-z0-9_])(?:" + "|".join(map(re.escape, runs))
                                  + r")(?![A-Za-z0-9_])")
                       if runs else None)
        self.roots = sorted({r.rstrip("/") for r in roots if r and r.rstrip("/")}, key=len, reverse=True)
        self.exact: dict[str, str] = {}
        self.exact_re: re.Pattern | None = None
        self.attempts: dict[str, str] = {}

    def with_batches(self, mapping: dict[str, str]) -> Normalizer:
        self.exact = dict(mapping)
        self.exact_re = (re.compile("|".join(map(re.escape, sorted(mapping, key=len, reverse=True))))
                         if mapping else None)
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
            attempt = attempt_of(envelope, rollout) if rollout else ""
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
        data = envelope.to_json()
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
            groups = tuple(normalizer.text(g) for g in envelope.payload.group_ids)
            out.setdefault(groups, envelope.payload.batch_id)
    return out


def _row_key(row: BatchRow, normalizer: Normalizer) -> tuple[str, int]:
    return normalizer.text(row.rollout_id), row.segment_index


def _row_fields(row: BatchRow, normalizer: Normalizer) -> dict[str, Any]:
    data = asdict(row)
    # float32 columns, shown as such
    data["reward"], data["advantage"] = float32_value(row.reward), float32_value(row.advantage)
    data["rollout_logprobs"] = [float32_value(x) for x in row.rollout_logprobs]
    return {k: normalizer.value(v) if isinstance(v, (str, dict, list)) else v for k, v in data.items()}


def compare_batch_rows(a: SideEvents, b: SideEvents, event_a: BatchReady, event_b: BatchReady,
                       na: Normalizer, nb: Normalizer) -> RowsDiff:
    diff = RowsDiff()
    rows = []
    for side, event in ((a, event_a), (b, event_b)):
        try:
            rows.append(open_batch_rows(side.source.storage_uri, side.source.run, event.uri))
        except Exception as exc:
            rows.append(exc)
    if isinstance(rows[0], Exception) or isinstance(rows[1], Exception):
        problems = [f"{side.label}: {type(r).__name__}: {r}" for side, r in zip((a, b), rows)
                    if isinstance(r, Exception)]
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
    diff.only_b.extend(f"({r.rollout_id}, {r.segment_index})" for key, r in keyed_b.items()
                       if key not in keyed_a)
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
            result.notes.append(f"{side.label}: {side.undecodable[stream]} entries do not decode "
                                "(not compared)")
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
        table.add_row(s.stream, str(s.identical), str(len(s.only_a)), str(len(s.only_b)),
                      str(len(s.different)), style=style)
    out: list[Any] = [table]
    for s in report.streams:
        for note in s.notes:
            out.append(Text(f"{s.stream}: note: {note}", style="yellow"))
        for event in s.different[:limit]:
            changes = ", ".join(map(str, event.changes)) if event.changes else "event identical"
            line = f"{s.stream} {event.key}: " + changes
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
