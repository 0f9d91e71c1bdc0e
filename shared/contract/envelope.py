"""The envelope around every event: what a stream entry carries besides its payload (its type and schema
version, an event id, the run id, the time, and the ids of the rollout it belongs to), and make_envelope(),
which wraps a payload and checks the ids it is given. The codec (codec.py) puts an envelope on a stream and
reads it back.

    python -m pytest tests/unit/shared/contract/test_envelope.py -q
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Generic, TypeVar

import msgspec

from rollstream.shared.contract.event_ids import new_event_id
from rollstream.shared.contract.event_models import Event
from rollstream.shared.contract.event_structs import FLOAT_MAX
from rollstream.shared.contract.streams import EVENT_TYPES

Payload = TypeVar("Payload", bound=Event)


# gc=False: the collector need not track an envelope, which can be in no cycle (it holds the wire's data)
class Envelope(msgspec.Struct, Generic[Payload], frozen=True, kw_only=True, forbid_unknown_fields=True,
               gc=False):
    """What every stream entry carries around its payload. `Envelope[SomeEvent]` checks its payload as that
    event class (how decode() checks an entry in one pass); every envelope is of the one class `Envelope`.

    A msgspec Struct, not a model like its payload: every entry a service reads makes one, and a Struct costs
    a fraction of a model to make. msgspec checks its fields where it decodes one (decode()); make_envelope()
    checks the ids it is given."""

    type: str
    """The payload's event type (its TYPE), as the entry's `type` field also says."""
    schema_version: int
    """The payload's schema version (its VERSION), as the entry's `v` field also says."""
    event_id: str
    """Unique per event: derived from what it is where a handler may publish it twice (e.g.
    `{rollout}:{attempt}:finished`, `{rollout}:reward`, `policy:v{version}`), else 32 hex digits unique to
    the process and the event (event_ids.py)."""
    run_id: str
    """The run it belongs to (its namespace in Redis and its folder in run storage)."""
    time: Annotated[float, msgspec.Meta(ge=-FLOAT_MAX, le=FLOAT_MAX)]
    """When it was published: Unix time in seconds on the publisher's clock; finite (readers bucket by it)."""
    trajectory_id: str | None = None
    """The trajectory it records: the rollout id, unless a gateway session was created with another;
    None, like the other ids, for an event of no rollout (BatchReady, PolicyUpdated)."""
    rollout_id: str | None = None
    """The rollout (one admitted sample, `{run}-r{sample_index:07d}` from the dispatcher) it is about."""
    group_id: str | None = None
    """Its prompt group (`{run}-g{group_index:06d}` from the dispatcher): rewards are relative within it."""
    session_id: str | None = None
    """What its generations are routed by (one server keeps the prefix cache): the rollout id, or the gateway
    session's id."""
    payload: Payload
    """The event itself, of the class `type` names."""

    def to_json(self) -> dict[str, Any]:
        """The envelope as JSON values, its payload as its model dumps it (token arrays as lists)."""
        return {**msgspec.structs.asdict(self), "payload": self.payload.model_dump(mode="json")}


ENVELOPE_IDS = ("trajectory_id", "rollout_id", "group_id", "session_id")
"""The ids an envelope belongs to."""


def make_envelope(payload: Event, *, run_id: str, event_id: str | None = None,
                  trajectory_id: str | None = None, rollout_id: str | None = None,
                  group_id: str | None = None, session_id: str | None = None) -> Envelope:
    """Wrap a payload. Pass a deterministic `event_id` where a handler may run twice. The ids must be str or
    None, as the Envelope's fields say (a TypeError names the one that is not)."""
    return Envelope(**envelope_fields(payload, run_id, event_id, trajectory_id, rollout_id, group_id,
                                      session_id))


def envelope_fields(payload: Event, run_id: str, event_id: str | None, trajectory_id: str | None,
                    rollout_id: str | None, group_id: str | None, session_id: str | None) -> dict[str, Any]:
    """A new envelope's fields, in the Envelope's order; a TypeError for an argument no envelope holds. The
    codec encodes them as they are, without making the Envelope (codec.encode_event)."""
    if not (type(payload) in _CONTRACT_EVENTS and type(run_id) is str and type(event_id) in _IDS
            and type(trajectory_id) in _IDS and type(rollout_id) in _IDS and type(group_id) in _IDS
            and type(session_id) in _IDS):
        _check_types(payload, run_id, event_id=event_id, trajectory_id=trajectory_id, rollout_id=rollout_id,
                     group_id=group_id, session_id=session_id)
    return {"type": payload.TYPE, "schema_version": payload.VERSION,
            "event_id": event_id or new_event_id(), "run_id": run_id, "time": time.time(),
            "trajectory_id": trajectory_id, "rollout_id": rollout_id, "group_id": group_id,
            "session_id": session_id, "payload": payload}


_CONTRACT_EVENTS = frozenset(EVENT_TYPES.values())
_IDS = frozenset((str, type(None)))


def _check_types(payload: Event, run_id: str, **ids: str | None) -> None:
    """A TypeError naming the argument no envelope holds; none for an Event subclass outside
    EVENT_TYPES, which fails envelope_fields' quick check but encodes all the same."""
    if not isinstance(payload, Event):
        raise TypeError(f"the payload must be an Event, not {type(payload).__name__}")
    for name, value in {"run_id": run_id, **ids}.items():
        if type(value) is not str and (value is not None or name == "run_id"):  # msgpack has no str subclass
            raise TypeError(f"{name} must be a str{'' if name == 'run_id' else ' or None'}, "
                            f"not {type(value).__name__}")
