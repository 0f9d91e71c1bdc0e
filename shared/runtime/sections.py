"""The base of every section of the run's settings (config.py's BusSettings, GatewaySettings, ...): unknown
fields refused, each field documented by the docstring under it. A module of its own, so that a section kept
outside config.py (console_settings.py) shares it without importing config.py.

    python -m pytest tests/unit/shared/runtime/test_config.py -q
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
