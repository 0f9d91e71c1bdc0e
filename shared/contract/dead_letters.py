"""Dead letters: an entry that a consumer group cannot handle leaves the group's work for the run's `dead`
stream, with why, and the pipeline goes on.

An entry goes at once when it does not decode, or is an event its stream does not carry (codec.decode_on).
One whose handler keeps failing goes once the group has been handed it more than bus.max_deliveries times
(reclaim.py counts the deliveries), with the handler's last error, which record_failure keeps for the group
until then. A service may give an entry up for a reason of its own (the trainer: a batch whose file is not
the batch it announces). The move is one transaction: the DeadLettered event (event_models/dead_letters.py),
with the entry's ids where it is an event of its stream, so that the reward service can drop its rollout
from its group; the acknowledgement; the removal of the kept error.

    python -m pytest tests/unit/shared/contract/test_dead_letters.py -q
"""

from __future__ import annotations

import logging

import redis

from rollstream.shared.contract.codec import decode_on, encode_event
from rollstream.shared.contract.envelope import ENVELOPE_IDS
from rollstream.shared.contract.event_models.dead_letters import DeadLettered
from rollstream.shared.contract.keys import Keys
from rollstream.shared.contract.streams import StreamName
from rollstream.shared.errors import EventDecodeError
from rollstream.shared.runtime.metrics import DEAD_LETTERS

log = logging.getLogger(__name__)

DEAD_LETTER_FIELD_CHARS = 65_536
"""Characters of each field a dead letter shows of its entry."""
KEPT_ERROR_CHARS = 2000
"""Characters of a handler's error kept for its entry's dead letter: the end, where the error is."""


class DeadLetters:
    """One run's dead letters on its Redis: the handlers' errors kept for them, and the move to `dead`."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys

    def record_failure(self, stream: StreamName, group: str, entry_id: str, error: str) -> None:
        """Keep a handler's error so that the dead letter, if it comes to that, says what failed."""
        self.redis.hset(self._errors_key(stream, group), entry_id, error[-KEPT_ERROR_CHARS:])

    def give_up(self, stream: StreamName, group: str, entry_id: str, fields: dict, deliveries: int) -> None:
        """Dead-letter an entry whose group was handed it `deliveries` times, too many, with the error its
        handler last recorded."""
        last_error = self.redis.hget(self._errors_key(stream, group), entry_id)
        self.move(stream, group, entry_id, fields, deliveries,
                  f"gave up after {deliveries - 1} failed deliveries; last error: "
                  f"{_show(last_error) if last_error else 'unknown'}")

    def move(self, stream: StreamName, group: str, entry_id: str, fields: dict, deliveries: int,
             error: str) -> None:
        """Move an entry to the dead-letter stream and acknowledge it, atomically. The dead letter carries
        the entry's ids when the entry is an event of the stream, so that the rollout it belonged to can be
        accounted for (the reward service drops it from its group with the reason)."""
        shown = {_clip(_show(k)): _clip(_show(v)) for k, v in fields.items()}
        event = DeadLettered(stream=stream, entry_id=entry_id, group=group, deliveries=deliveries,
                             error=error, fields=shown)
        try:  # an event that does not belong on the stream is no part of its rollout's work: no ids
            envelope = decode_on(stream, fields)
            ids = {name: getattr(envelope, name) for name in ENVELOPE_IDS}
        except EventDecodeError:
            ids = {}
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(self.keys.stream("dead"), encode_event(event, run_id=self.keys.run_id, **ids))
        pipe.xack(self.keys.stream(stream), group, entry_id)
        pipe.hdel(self._errors_key(stream, group), entry_id)
        pipe.execute()
        DEAD_LETTERS.labels(stream, group).inc()
        log.warning("dead-lettered entry", extra={"stream": stream, "entry_id": entry_id, "error": error})

    def _errors_key(self, stream: StreamName, group: str) -> str:
        return self.keys.state("bus", "errors", stream, group)


def _clip(text: str) -> str:
    """A dead letter shows at most DEAD_LETTER_FIELD_CHARS of a field: a poison entry of megabytes, shown
    as repr once per consumer group, must not multiply on `dead` (the archive keeps the entry whole)."""
    if len(text) <= DEAD_LETTER_FIELD_CHARS:
        return text
    return f"{text[:DEAD_LETTER_FIELD_CHARS]}... [cut: {len(text)} characters]"


def _show(value: bytes | str) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return repr(value)
