"""How samples are generated (`rollout.*`, RS_ROLLOUT__*): tokens and temperature of a turn, episodes at once
on an agent-runner, and the seed that makes a black-box turn reproducible.

    python -m pytest tests/unit/shared/runtime/test_config.py -q
"""

from __future__ import annotations

from pydantic import Field

from rollstream.shared.runtime.sections import Section


class RolloutSettings(Section):
    max_tokens: int = Field(32, ge=1)
    """Tokens generated per turn."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature."""
    concurrency: int = Field(32, ge=1)
    """Episodes one agent-runner replica runs at once."""
    seed: int | None = None
    """Black-box episodes: when set, every turn of a rollout's gateway session is sampled with a seed derived
    from it and the rollout id (the sample's metadata says it: sampling_seed), so a recorded turn can be
    sampled again, id for id. None: vLLM draws its own."""
