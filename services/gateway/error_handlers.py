"""How a failure reaches the client: under /s/{id}, in the shape of the API the request was for (Anthropic's
for /v1/messages, OpenAI's otherwise: apis/errors.py), so its SDK raises its usual exception with our
message; a body the sessions API cannot read is a 422 whose `detail` lists what is wrong, as FastAPI's own.

    python -m pytest tests/unit/services/gateway/test_gateway_app.py -q
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rollstream.services.gateway.apis.errors import RequestError, anthropic_error, openai_error
from rollstream.shared.errors import FleetRequestError, FleetUnavailable, TemplateError, UnknownRole
from rollstream.shared.inference.fleet_servers import FleetSettingsError


def api_of(path: str) -> str:
    return "anthropic" if "/v1/messages" in path else "openai"


def error_response(api: str, status: int, message: str, param: str | None = None) -> JSONResponse:
    body = anthropic_error(status, message) if api == "anthropic" else openai_error(status, message, param)
    return JSONResponse(body, status_code=status)


def jsonable_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    return [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]


async def request_error(request: Request, exc: RequestError) -> JSONResponse:
    return error_response(api_of(request.url.path), exc.status, exc.message, exc.param)


async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    if request.url.path.startswith("/s/"):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return error_response(api_of(request.url.path), 400, f"invalid request: {problems}")
    return JSONResponse({"detail": jsonable_errors(exc)}, status_code=422)


async def no_server(request: Request, exc: FleetUnavailable) -> JSONResponse:
    return error_response(api_of(request.url.path), 503, f"no vLLM server can serve the turn: {exc}")


async def refused(request: Request, exc: FleetRequestError) -> JSONResponse:
    return error_response(api_of(request.url.path), 400, f"vLLM refused the turn: {exc}")


async def misconfigured(request: Request, exc: FleetSettingsError) -> JSONResponse:
    # A server met after the start (it did not answer then) that disagrees with the settings: the fault is
    # the deployment's, not the request's.
    return error_response(api_of(request.url.path), 500,
                          f"the gateway's settings disagree with a vLLM server: {exc}")


async def unrenderable(request: Request, exc: TemplateError) -> JSONResponse:
    return error_response(api_of(request.url.path), 400, f"the chat template cannot render this: {exc}")


async def unknown_role(request: Request, exc: UnknownRole) -> JSONResponse:
    # a session created for a role that the gateway's settings no longer have (settings changed since)
    return error_response(api_of(request.url.path), 400, f"this session's role cannot be sampled: {exc}")


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(FleetUnavailable, no_server)
    app.add_exception_handler(FleetRequestError, refused)
    app.add_exception_handler(FleetSettingsError, misconfigured)
    app.add_exception_handler(TemplateError, unrenderable)
    app.add_exception_handler(UnknownRole, unknown_role)
