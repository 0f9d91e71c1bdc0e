"""The sections of the run's settings (config.py's `Settings`), one module per section, each named as its
field of Settings is (`bus.*`: bus.py's BusSettings, RS_BUS__*): bus, model, roles, fleet, data, rollout,
agent, train, grader, reward, recorder, gateway, console, security.

Here: `Section`, the base of every one: unknown fields refused, each field documented by the docstring under
it (`rollstream config --markdown` prints them as the configuration reference).

    python -m pytest tests/unit/shared/runtime/test_config.py -q
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
