"""The HTTP API every service serves (shared/runtime/service.py): its routes, who may call them, and its
OpenAPI document.

    GET /healthz        200 ready, 503 not ready (with the reason); always open: orchestrators probe it
    GET /openapi.json   this API's description; always open (it holds no secret)
    GET /metrics        Prometheus; asks for security.metrics_token, else security.http_token, unless
                        security.metrics_open
    anything else       asks for security.http_token, then 404

A route that asks for a token and gets no `Authorization: Bearer ...` answers 401 with
`WWW-Authenticate: Bearer`; one that gets another token answers 403. Tokens are compared in constant
time. Every method but GET answers 405.
"""

from __future__ import annotations

import hashlib
import hmac

from pydantic import SecretStr

from rollstream.shared.runtime.config import SecuritySettings

OPEN_ROUTES = frozenset({"/healthz", "/openapi.json"})
REALM = "rollstream"


def required_token(route: str, security: SecuritySettings) -> SecretStr | None:
    """The token a request for this route must present; None: the route is open."""
    if route in OPEN_ROUTES:
        return None
    if route == "/metrics":
        return None if security.metrics_open else security.metrics_token or security.http_token
    return security.http_token


def auth_failure(authorization: str | None, token: SecretStr | None) -> int | None:
    """None when the request may go on; 401 when it presents no bearer token, 403 when another one."""
    if token is None:
        return None
    scheme, _, presented = (authorization or "").strip().partition(" ")
    presented = presented.strip()
    if scheme.lower() != "bearer" or not presented:
        return 401
    # Digests of both: compare_digest then takes as long whatever the presented token's length.
    expected = hashlib.sha256(token.get_secret_value().encode()).digest()
    given = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
    return None if hmac.compare_digest(expected, given) else 403


def challenge(status: int) -> dict[str, str]:
    """The headers of an auth failure (RFC 6750)."""
    if status == 401:
        return {"WWW-Authenticate": f'Bearer realm="{REALM}"'}
    return {"WWW-Authenticate": f'Bearer realm="{REALM}", error="invalid_token"'}


def openapi_document(service: str, security: SecuritySettings) -> dict:
    """OpenAPI 3.0 description of a service's routes, as configured (which ones ask for a token)."""
    error = {"description": "", "content": {"application/json": {"schema": {
        "type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}}}}
    denied = {
        "401": {**error, "description": "No bearer token (WWW-Authenticate: Bearer)."},
        "403": {**error, "description": "Not the configured token."},
    }
    health = {"type": "object", "required": ["service", "status", "uptime_s"], "properties": {
        "service": {"type": "string"}, "status": {"type": "string", "enum": ["ok", "not ready", "stopping"]},
        "reason": {"type": "string"}, "uptime_s": {"type": "number"}}}
    metrics_secured = required_token("/metrics", security) is not None
    return {
        "openapi": "3.0.3",
        "info": {"title": f"rollstream {service}", "version": "1",
                 "description": "Health and metrics of one rollstream service."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/healthz": {"get": {
                "operationId": "healthz", "summary": "Whether the service can do its work now.",
                "security": [],
                "responses": {
                    "200": {"description": "Ready.", "content": {"application/json": {"schema": health}}},
                    "503": {"description": "Not ready or stopping; `reason` says why.",
                            "content": {"application/json": {"schema": health}}},
                }}},
            "/metrics": {"get": {
                "operationId": "metrics", "summary": "Prometheus metrics.",
                "security": [{"bearer": []}] if metrics_secured else [],
                "responses": {
                    "200": {"description": "Prometheus text format.",
                            "content": {"text/plain": {"schema": {"type": "string"}}}},
                    **(denied if metrics_secured else {}),
                }}},
            "/openapi.json": {"get": {
                "operationId": "openapi", "summary": "This document.", "security": [],
                "responses": {"200": {"description": "OpenAPI 3.0.",
                                      "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        },
    }
