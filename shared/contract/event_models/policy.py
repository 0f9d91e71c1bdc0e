"""The training stage: a policy version trained on a batch and served by the fleet (stream `policy`), which
the dispatcher's admission waits on.

    python -m pytest tests/unit/shared/contract/test_events.py -q
"""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from rollstream.shared.contract.event_models import Event, Index


class PolicyUpdated(Event):
    """The fleet serves a new policy version, checked for logprob parity (stream `policy`). Published by the
    trainer for each batch it trained. No consumer group reads `policy`: the dispatcher watches it for the
    version that lets it admit more, a restarted trainer resumes from its own last one, `rollstream inspect`
    shows it."""

    TYPE = "PolicyUpdated"
    VERSION = 2  # v2: role_versions
    version: Index
    """The new version: one more than the last (0 is the starting model). The trainer's step: each batch
    makes one, whichever roles it trains."""
    checkpoint_uri: str
    """Local directory of its training state (the weights the fleet loads, optimizer, RNG):
    `<run>/checkpoints/v<n>`."""
    batch_id: str
    """The batch (BatchReady.batch_id) it was trained on."""
    servers: list[str]
    """URLs of the vLLM servers that loaded it."""
    parity_max_abs_diff: float
    """Largest absolute difference, over the servers, between their prompt logprobs of a probe and the
    trainer's."""
    loss: float
    """The step's training loss (metrics["train/loss"]; 0.0 when no row had a sampled token)."""
    trained_samples: int
    """Batch rows (segments) trained on, those dropped left out."""
    dropped: dict[str, int] = {}
    """Samples of the batch left out of training, by reason (`stale`: older than train.max_staleness;
    `invalid`: rows no model can train on)."""
    metrics: dict[str, float] = {}
    """The step's training metrics (loss terms, importance weights, staleness, timings), as tracked."""
    role_versions: dict[str, Index] = {}
    """Each trained role's version after the step (roles.names): a role's grows by one with each batch that
    trains it, so a role the batch held no sample of keeps its own. The fleet serves each at that version. A
    run of one full-model role: {role: version}; empty (an update recorded before roles existed): the
    default role's is `version`."""

    @model_validator(mode="before")
    @classmethod
    def _without_the_old_stale_count(cls, data: Any) -> Any:
        # Runs recorded before it was removed carry `dropped_stale`, a copy of dropped["stale"]: their
        # archives must still replay and inspect.
        if isinstance(data, dict) and "dropped_stale" in data:
            return {key: value for key, value in data.items() if key != "dropped_stale"}
        return data
