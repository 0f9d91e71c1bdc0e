"""The bus's own event: an entry that no consumer could handle, moved to the run's `dead` stream with why
(shared/contract/dead_letters.py moves it).

    python -m pytest tests/unit/shared/contract/test_events.py -q
"""

from __future__ import annotations

from rollstream.shared.contract.event_models import Event


class DeadLettered(Event):
    """An entry that could not be handled (stream `dead`). Published by the bus for the consumer group that
    gave it up (Bus.dead_letter), with the entry's ids when it decoded. The `reward` group drops the rollout
    of a dead-lettered prompt, trajectory or grade event; `rollstream run` and the chaos audits report it."""

    TYPE = "DeadLettered"
    stream: str
    """The stream the entry was on."""
    entry_id: str
    """Its Redis stream entry id there."""
    group: str
    """The consumer group that gave it up."""
    deliveries: int
    """How many times the group was handed it (1: refused at once, e.g. an entry that does not decode)."""
    error: str
    """Why: the decode error, the handler's last error after bus.max_deliveries, or the service's own
    reason."""
    fields: dict[str, str]
    """The original entry's fields, bytes shown as repr where not UTF-8."""
