"""Trimming a stream behind the slowest consumer group and, when recording, behind the archived
position: nothing undelivered, pending or unarchived is trimmed. Redis 7.0 and Valkey.

    python -m pytest tests/unit/shared/contract/test_archive.py -q
"""

from __future__ import annotations

import redis

from rollstream.shared.contract.archive.layout import as_text, format_id, next_id, parse_id
from rollstream.shared.contract.archive.position import archived_id
from rollstream.shared.contract.bus import Bus, StreamName
from rollstream.shared.contract.consumers import unconsumed_streams

UNCONSUMED_STREAMS: tuple[StreamName, ...] = unconsumed_streams()
"""Streams that no service reads through a consumer group (people, the archive and Bus.last read them): with
no group to wait for, they are trimmed as soon as they are archived, or Redis would grow by an entry per
rollout for the whole run."""


def trim_safe_id(bus: Bus, stream: StreamName, require_archived: bool = True) -> str | None:
    """The highest entry id that may be trimmed, with every entry before it; None: nothing may.

    An entry may go once every consumer group of the stream has had it delivered and acknowledged,
    and, with `require_archived` (recording on), once it is archived. A stream with no group keeps
    everything, except the streams that no consumer group ever reads (UNCONSUMED_STREAMS), which are
    trimmed behind the archive alone (with recording on). The newest entry that decodes always stays,
    with everything after it: `Bus.last` reads current state from it (the policy version a restarted
    dispatcher or trainer resumes from).

    A group created after this returns finds the stream as if it had been created after the trim:
    it never had a claim on what was cut.
    """
    key = bus.keys.stream(stream)
    try:
        groups = bus.redis.xinfo_groups(key)
    except redis.ResponseError:  # no such stream
        return None
    if not groups and not (require_archived and stream in UNCONSUMED_STREAMS):
        return None
    # Keep the newest entry that decodes (and what follows it), not only the newest: Bus.last reads it,
    # and a malformed entry after it must not make the current state disappear.
    newest_event = bus.last(stream)
    if newest_event is None:
        return None
    before = bus.redis.xrevrange(key, max=f"({newest_event.entry_id}", count=1)
    if not before:
        return None
    bounds = [parse_id(as_text(before[0][0]))]
    if require_archived:
        archived = archived_id(bus, stream)
        if archived is None:
            return None
        bounds.append(parse_id(archived))
    for info in groups:
        if int(info["pending"]):
            summary = bus.redis.xpending(key, info["name"])
            if summary["pending"]:
                # Everything strictly older than the group's oldest pending entry has been acked.
                before = bus.redis.xrevrange(key, max=f"({as_text(summary['min'])}", min="-", count=1)
                if not before:
                    return None
                bounds.append(parse_id(as_text(before[0][0])))
                continue
        bounds.append(parse_id(as_text(info["last-delivered-id"])))
    bound = min(bounds)
    return None if bound == (0, 0) else format_id(bound)


def trim_stream(bus: Bus, stream: StreamName, require_archived: bool = True) -> int:
    """Trim the entries up to trim_safe_id; returns how many were removed."""
    safe = trim_safe_id(bus, stream, require_archived)
    if safe is None:
        return 0
    # MINID keeps ids >= its argument. Exact trimming ("=" rather than "~"): the bound is the point.
    return int(bus.redis.xtrim(bus.keys.stream(stream), minid=next_id(safe), approximate=False))
