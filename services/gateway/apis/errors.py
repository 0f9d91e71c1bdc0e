"""Why the gateway refuses a request (`RequestError`), and error bodies in each API's own shape, so a
client's SDK raises its usual exception with our message.

OpenAI (both APIs): `{"error": {"message", "type", "param", "code"}}`.
Anthropic: `{"type": "error", "error": {"type", "message"}}`, the type following the status.

`request_error_of` is for failures inside a stream, after the 200 has gone out: the stream driver
(sse.py) turns what the generation raised into the API's error event instead of cutting the connection.
"""

from __future__ import annotations

import logging
from typing import Any

from rollstream.shared.errors import RollstreamError

log = logging.getLogger(__name__)

ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class RequestError(RollstreamError, ValueError):
    """A request the gateway will not serve: `status` is the HTTP status to answer with, `message` says
    why in words a client's developer can act on, `param` names the field when one is at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind


def openai_error(status: int, message: str, param: str | None = None, kind: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    """`kind` is the error's `type`; left out, it is "server_error" for a 5xx status and
    "invalid_request_error" otherwise, as OpenAI answers."""
    if kind is None:
        kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def anthropic_error_type(status: int) -> str:
    return ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def request_error_of(error: Exception) -> RequestError:
    """A RequestError as it is; anything else is a fault of the gateway, logged here with its traceback
    (the client gets only its one-line summary) and reported as a 500."""
    if isinstance(error, RequestError):
        return error
    log.error("generation failed while streaming", exc_info=error)
    return RequestError(500, f"generation failed: {type(error).__name__}: {error}", kind="server_error")
