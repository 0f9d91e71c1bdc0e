"""Runs users can copy, each one command: `rollstream run --example NAME` (or `make run EXAMPLE=NAME`). An
example is the settings it changes (over the defaults, the environment and RS_CONFIG_FILE, which still set
the rest) and the dataset it writes into the run's folder.

- `relay`: two roles, a planner and a solver, as two LoRA adapters of the tiny model served by the one vLLM
  server, each trained on its own turns with its own reward (shared/agent/environments/relay.py).

    python -m pytest tests/unit/shared/agent/test_relay.py -q
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollstream.shared.runtime.config import Settings


@dataclass(frozen=True)
class Example:
    description: str
    settings: dict[str, Any]
    """The sections and fields it sets, as Settings(**settings) takes them."""
    dataset: Callable[[int], list]
    """Its prompt rows from the run's data.seed."""


def _relay() -> Example:
    from rollstream.shared.agent.environments import relay

    module = "rollstream.shared.agent.environments.relay"
    return Example(
        description="a planner and a solver, two LoRA adapters trained together on one fleet",
        settings={
            "roles": {"names": {"planner": {"reward_function": f"{module}:first_step"}, "solver": {}}},
            "reward": {"function": f"{module}:final_answer"},
            # a LoRA adapter takes a larger step than the whole model (train.learning_rate's 3e-4)
            "train": {"lora_rank": 8, "lora_alpha": 16, "learning_rate": 2e-3},
        },
        dataset=lambda seed: relay.relay_dataset(1000, seed),
    )


EXAMPLES: dict[str, Callable[[], Example]] = {"relay": _relay}


def example_settings(name: str, run_id: str, **more: Any) -> Settings:
    """The settings of the example `name` for run `run_id`, with `more` (fields and sections, as Settings
    takes them; a section's fields merge into the example's), its dataset written to the run's folder
    (data.path); ValueError naming the examples for an unknown one."""
    if name not in EXAMPLES:
        raise ValueError(f"no example {name!r}; the examples: {', '.join(sorted(EXAMPLES))}")
    example = EXAMPLES[name]()
    fields = _merged(example.settings, {"run_id": run_id, **more})
    settings = Settings(**fields)
    path = settings.run_dir() / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = example.dataset(settings.data.seed)
    path.write_text("".join(json.dumps(_record(row)) + "\n" for row in rows))
    return Settings(**_merged(fields, {"data": {"path": str(path)}}))


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over`'s fields, sections merged field by field (over's win)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def _record(row) -> dict[str, Any]:
    """A prompt row as a dataset line (shared/tasks/rows.py parses it back)."""
    record = row.model_dump(mode="json", exclude_defaults=True)
    record["prompt"] = record.pop("messages")
    return record


def describe() -> str:
    return "; ".join(f"{name}: {factory().description}" for name, factory in sorted(EXAMPLES.items()))


__all__ = ["EXAMPLES", "Example", "describe", "example_settings"]
