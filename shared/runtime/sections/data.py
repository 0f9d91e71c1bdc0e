"""The dataset's settings (`data.*`, RS_DATA__*): the prompts a run draws its samples from, and how many
samples each prompt's group holds.

    python -m pytest tests/unit/shared/runtime/test_config.py -q
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from rollstream.shared.runtime.sections import Section


class DataSettings(Section):
    path: Path | None = None
    """Prompt dataset (.parquet or .jsonl, a `prompt` column); None: the synthetic arithmetic task."""
    samples_per_prompt: int = Field(8, ge=1)
    """Samples per prompt group (n)."""
    synthetic_prompts: int = Field(1000, ge=1)
    """Size of the synthetic arithmetic dataset."""
    synthetic_sandbox_every: int = Field(4, ge=0)
    """Every k-th synthetic prompt is graded by a sandboxed check instead of a rule; 0: none."""
    seed: int = 0
    """Seed of the synthetic dataset and of the prompt order."""
