"""The security settings (`security.*`, RS_SECURITY__*): the bearer tokens of the services' HTTP routes; and
how every secret of the settings is read (secret_input): an empty one is none, a dump's mask is refused.

    python -m pytest tests/unit/shared/runtime/test_config.py -q
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, SecretStr, field_validator

from rollstream.shared.runtime.sections import Section

SECRET_MASK = "**********"
"""How pydantic prints a SecretStr; read back as a value, it is a dump's mask, never the secret."""


def secret_input(value: Any) -> Any:
    """An empty secret is no secret (compose writes `${VAR:-}` as ""); a masked one is refused, because a
    dump of the settings read back would otherwise connect with the mask as its password."""
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if value == "":
        return None
    if value == SECRET_MASK:
        raise ValueError("this is the masked form of a secret (a dump of the settings read back): "
                         "set the secret itself, e.g. through its environment variable")
    return value


class SecuritySettings(Section):
    # a rejected value must not be echoed into a log by the validation error
    model_config = ConfigDict(hide_input_in_errors=True)

    http_token: SecretStr | None = Field(None, min_length=16, max_length=4096)
    """Bearer token (`Authorization: Bearer <token>`) every HTTP route of a service asks for, except /healthz
    and /openapi.json; unset: the routes are open."""
    metrics_token: SecretStr | None = Field(None, min_length=16, max_length=4096)
    """Bearer token of /metrics when a scraper has its own; unset: /metrics asks for http_token."""
    metrics_open: bool = False
    """Serve /metrics without a token even when tokens are set (a scraper on a trusted network)."""

    @field_validator("http_token", "metrics_token", mode="before")
    @classmethod
    def _no_masked_or_empty_secrets(cls, value: Any) -> Any:
        return secret_input(value)
