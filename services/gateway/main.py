"""Gateway: OpenAI- and Anthropic-compatible endpoints through which agents rollstream did not write are trained.

A session is one rollout. Whoever runs the agent (the agent-runner's black-box mode, or a user's own
harness) creates it with the rollout's ids and grader, gives the agent only the session's base URL and
key, and finishes it (optionally with a reward); the gateway then publishes the session's samples on
`trajectories` like any other rollout (samples.py), and the rest of the pipeline grades, rewards and trains
them.

    POST   /v1/sessions                     create: ids, grader, sampling defaults, time budget -> URLs, key
    GET    /v1/sessions/{id}                read
    POST   /v1/sessions/{id}/finish         finish: status, reward, artifacts -> samples published
    DELETE /v1/sessions/{id}                discard (nothing published)
    (these ask for security.http_token when it is set; a session with a time budget refuses turns from its
    deadline on and ends gateway.finish_grace_s later, finished or not: sessions.py)

    under /s/{id} (the Anthropic base URL; /s/{id}/v1 is the OpenAI one), with the session's key as
    `Authorization: Bearer` or `x-api-key`:
    POST /v1/chat/completions    POST /v1/responses    POST /v1/messages    POST /v1/messages/count_tokens
    GET  /v1/models
    and without a key, GET or HEAD on either base URL itself: 200 (Claude Code probes it before it starts)

Every turn is rendered with the served model's chat template and generated token-in/token-out; the prompt
continues the session's earlier turns with their exact ids (prompts.py), and the tokens go to the client as
vLLM produces them (turns.py). Session state is in Redis (sessions.py): replicas are stateless and any
replica serves any turn. Errors come in each API's own shape; bad input is a 4xx that says why. Tools the
model cannot be shown (hosted tools: web search, code execution, ...) are left out, logged, and named in the
response's x-rollstream-ignored-tools header (gateway.strict_tools refuses them instead).

    rollstream-gateway           # configured by RS_* variables or RS_CONFIG_FILE
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn
from fastapi import Body, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field

from rollstream.services.gateway.apis import anthropic_messages, openai_chat, openai_responses
from rollstream.services.gateway.apis.canonical import ChatRequest, RequestError
from rollstream.services.gateway.apis.errors import anthropic_error, openai_error
from rollstream.services.gateway.prompts import ChatTemplate, plan_turn
from rollstream.services.gateway.samples import publish_samples
from rollstream.services.gateway.sessions import Session, SessionSpec, SessionStore
from rollstream.services.gateway.turns import Gateway, generate, run_turn
from rollstream.shared.contract.bus import Bus
from rollstream.shared.errors import FleetRequestError, FleetUnavailable, TemplateError
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.health_api import auth_failure
from rollstream.shared.runtime.service import ServiceRuntime

STALL_CHECK_S = 0.05
WORKER_THREADS = 64
LOAD_REFRESH_S = 1.0
"""How often each vLLM server's /metrics (running, waiting, KV-cache use) is read for routing."""
LOOP_STALL = Gauge("rollstream_gateway_event_loop_stall_max_seconds",
                   "Longest the gateway's event loop was late to wake up since the process started")
SESSIONS_CREATED = Counter("rollstream_gateway_sessions_created_total", "Sessions this replica created")
IGNORED_TOOLS_HEADER = "x-rollstream-ignored-tools"


class SamplingDefaults(BaseModel):
    """A session's defaults for every turn; a request's own values win."""

    model_config = ConfigDict(extra="forbid")
    temperature: float | None = Field(None, ge=0, le=10)
    max_tokens: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    min_tokens: int | None = Field(None, ge=0)
    """Sample at least this many tokens before a stop (vLLM's min_tokens)."""
    ignore_eos: bool | None = None
    """Sample past end-of-sequence until max_tokens (benchmarks, long streams)."""


class SessionCreate(BaseModel):
    rollout_id: str = Field(min_length=1, max_length=256)
    group_id: str = Field(min_length=1, max_length=256)
    trajectory_id: str | None = Field(None, min_length=1, max_length=256)
    session_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    sample_index: int = Field(0, ge=0)
    group_size: int = Field(1, ge=1)
    label: str | None = None
    reward_fn: str = "exact_match"
    sandbox_check: str | None = None
    grader: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    sampling: SamplingDefaults = SamplingDefaults()
    time_budget_s: float | None = Field(None, gt=0)


class SessionFinish(BaseModel):
    status: str = Field("completed", pattern=r"^(completed|truncated|aborted|failed)$")
    reward: float | None = Field(None, allow_inf_nan=False)
    response_text: str | None = None
    artifacts: dict[str, str] = {}
    error: str | None = Field(None, max_length=65536)


QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
EXAMPLES = {  # shown in the OpenAPI document, and what a fuzzer's examples phase sends
    "chat": {"model": "any", "messages": QUESTION, "max_tokens": 8},
    "responses": {"model": "any", "input": "What is 2 + 3?", "max_output_tokens": 8},
    "messages": {"model": "any", "max_tokens": 8, "messages": QUESTION},
    "count_tokens": {"model": "any", "messages": QUESTION},
}


def example_body(api: str) -> Any:
    return Body(..., openapi_examples={"question": {"summary": "a one-turn question", "value": EXAMPLES[api]}})


def api_of(path: str) -> str:
    return "anthropic" if "/v1/messages" in path else "openai"


def error_response(api: str, status: int, message: str, param: str | None = None) -> JSONResponse:
    body = anthropic_error(status, message) if api == "anthropic" else openai_error(status, message, param)
    return JSONResponse(body, status_code=status)


def build_app(gateway: Gateway, runtime: ServiceRuntime) -> FastAPI:
    settings = gateway.settings
    store = gateway.store
    app = FastAPI(title="rollstream gateway", version="1")
    admin_token = settings.security.http_token

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(api_of(request.url.path), exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        if request.url.path.startswith("/s/"):
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            return error_response(api_of(request.url.path), 400, f"invalid request: {problems}")
        return JSONResponse({"detail": jsonable_errors(exc)}, status_code=422)

    def check_admin(authorization: str | None) -> None:
        denied = auth_failure(authorization, admin_token)
        if denied:
            raise RequestError(denied, "bearer token required" if denied == 401 else "wrong token",
                               kind="authentication_error" if denied == 401 else "permission_error")

    async def open_session(session_id: str, authorization: str | None, api_key: str | None) -> Session:
        session = await asyncio.to_thread(store.get, session_id)
        if session is None:
            raise RequestError(404, f"no session {session_id!r} (never created, deleted, or expired)",
                               kind="not_found_error")
        presented = api_key or (authorization[7:] if authorization and authorization.startswith("Bearer ") else None)
        if not session.accepts(presented):
            raise RequestError(401, "this session's API key is required (Authorization: Bearer, or x-api-key)",
                               kind="authentication_error")
        if session.status != "open":
            raise RequestError(410, f"session {session_id} is finished; open a new one", kind="invalid_request_error")
        if session.expired():
            raise RequestError(403, f"session {session_id}'s time budget of {session.spec.time_budget_s} s is spent",
                               kind="permission_error")
        return session

    # ------------------------------------------------------------------------------------ sessions
    @app.post("/v1/sessions", status_code=201)
    async def create_session(body: SessionCreate, request: Request,
                             authorization: str | None = Header(None)) -> dict[str, Any]:
        check_admin(authorization)
        session_id = body.session_id or uuid.uuid4().hex
        spec = SessionSpec(rollout_id=body.rollout_id, group_id=body.group_id,
                           trajectory_id=body.trajectory_id or body.rollout_id, session_id=session_id,
                           sample_index=body.sample_index, group_size=body.group_size, label=body.label,
                           reward_fn=body.reward_fn, sandbox_check=body.sandbox_check, grader=body.grader,
                           metadata=body.metadata, sampling=body.sampling.model_dump(exclude_none=True), time_budget_s=body.time_budget_s)
        created = await asyncio.to_thread(store.create, spec)
        if created is None:
            raise RequestError(409, f"session {session_id} exists already", kind="invalid_request_error")
        session, api_key = created
        SESSIONS_CREATED.inc()
        base = settings.gateway.url.rstrip("/") + f"/s/{session_id}"
        return {**session.describe(), "api_key": api_key, "openai_base_url": f"{base}/v1",
                "anthropic_base_url": base}

    @app.get("/v1/sessions/{session_id}")
    async def read_session(session_id: str, authorization: str | None = Header(None)) -> dict[str, Any]:
        check_admin(authorization)
        session = await asyncio.to_thread(store.get, session_id)
        if session is None:
            raise RequestError(404, f"no session {session_id!r}", kind="not_found_error")
        return session.describe()

    @app.post("/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, body: SessionFinish,
                             authorization: str | None = Header(None)) -> dict[str, Any]:
        check_admin(authorization)
        session = await asyncio.to_thread(store.get, session_id)
        if session is None:
            raise RequestError(404, f"no session {session_id!r} (never created, deleted, or ended: a session with "
                                    "a time budget ends gateway.finish_grace_s after its deadline)",
                               kind="not_found_error")
        if session.status != "open":
            raise RequestError(409, f"session {session_id} is finished already", kind="invalid_request_error")
        counted: list[int] = []

        def publish(pipe, samples) -> None:
            if not samples:
                raise RequestError(422, f"session {session_id} has no model turn: nothing to train on; "
                                        "delete it instead", kind="invalid_request_error")
            counted.append(len(samples))
            publish_samples(gateway.store.bus, pipe, session, samples, status=body.status, reward=body.reward,
                            response_text=body.response_text, artifacts=body.artifacts, error=body.error)

        if not await asyncio.to_thread(store.finish, session_id, publish):
            raise RequestError(409, f"session {session_id} was finished, or ended, meanwhile",
                               kind="invalid_request_error")
        runtime.log.info("session finished", extra={"session_id": session_id, "samples": counted[0],
                                                    "rollout_id": session.spec.rollout_id})
        return {"session_id": session_id, "status": "finished", "samples": counted[0]}

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    async def delete_session(session_id: str, authorization: str | None = Header(None)) -> Response:
        check_admin(authorization)
        if not await asyncio.to_thread(store.delete, session_id):
            raise RequestError(404, f"no session {session_id!r}", kind="not_found_error")
        return Response(status_code=204)

    # ------------------------------------------------------------------------- per-session APIs
    @app.api_route("/s/{session_id}", methods=["GET", "HEAD"])
    @app.api_route("/s/{session_id}/v1", methods=["GET", "HEAD"])
    async def base_url(session_id: str) -> Response:
        """Claude Code sends HEAD to its base URL, without a key, before its first request, and stops on an
        error: the base URLs answer 200, with nothing in them (so nothing that needs the key)."""
        return Response(status_code=200)

    def ignored_tools_headers(session: Session, chat: ChatRequest) -> dict[str, str]:
        """The response header naming the tools the model was not shown (none when it saw them all), after
        one log line about them; a 400 instead when gateway.strict_tools refuses them."""
        if not chat.ignored_tools:
            return {}
        listed = ",".join(chat.ignored_tools)
        if settings.gateway.strict_tools:
            raise RequestError(400, f"the request has tools the model cannot be shown (type {listed}; only "
                                    "function tools are), and this gateway refuses them "
                                    "(gateway.strict_tools): remove them", "tools")
        runtime.log.info("tools left out of the prompt", extra={"session_id": session.spec.session_id,
                                                                 "tool_types": listed})
        return {IGNORED_TOOLS_HEADER: listed}

    async def answer(session: Session, chat: ChatRequest, api: str, respond, stream) -> Response:
        headers = ignored_tools_headers(session, chat)
        if not chat.stream:
            generation = await generate(gateway, session, chat, api)
            return JSONResponse(respond(generation), headers=headers)
        events = run_turn(gateway, session, chat, api)
        # The first event comes after the prompt is planned and a server took the request: errors up to
        # there still get a status of their own.
        first = await anext(events)

        async def replay() -> AsyncIterator[Any]:
            yield first
            async for event in events:
                yield event

        return StreamingResponse(stream(replay()), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers})

    @app.post("/s/{session_id}/v1/chat/completions")
    async def chat_completions(session_id: str, body: dict[str, Any] = example_body("chat"),
                               authorization: str | None = Header(None),
                               x_api_key: str | None = Header(None)) -> Response:
        session = await open_session(session_id, authorization, x_api_key)
        chat = openai_chat.parse_chat_completions(body)
        response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        return await answer(
            session, chat, "chat",
            lambda g: openai_chat.chat_completion_response(g, model=chat.model, response_id=response_id,
                                                           created=created),
            lambda events: openai_chat.chat_completion_sse(events, model=chat.model, response_id=response_id,
                                                           created=created, include_usage=chat.include_usage))

    @app.post("/s/{session_id}/v1/responses")
    async def responses(session_id: str, body: dict[str, Any] = example_body("responses"), authorization: str | None = Header(None),
                        x_api_key: str | None = Header(None)) -> Response:
        session = await open_session(session_id, authorization, x_api_key)
        chat = openai_responses.parse_responses(body)
        response_id, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        return await answer(
            session, chat, "responses",
            lambda g: openai_responses.responses_response(g, chat, response_id=response_id, created=created),
            lambda events: openai_responses.responses_sse(events, chat, response_id=response_id,
                                                          created=created))

    @app.post("/s/{session_id}/v1/messages")
    async def messages(session_id: str, body: dict[str, Any] = example_body("messages"), authorization: str | None = Header(None),
                       x_api_key: str | None = Header(None)) -> Response:
        session = await open_session(session_id, authorization, x_api_key)
        chat = anthropic_messages.parse_messages(body)
        message_id = f"msg_{uuid.uuid4().hex}"
        return await answer(
            session, chat, "messages",
            lambda g: anthropic_messages.messages_response(g, model=chat.model, message_id=message_id),
            lambda events: anthropic_messages.messages_sse(events, model=chat.model, message_id=message_id))

    @app.post("/s/{session_id}/v1/messages/count_tokens")
    async def count_tokens(session_id: str, body: dict[str, Any] = example_body("count_tokens"), authorization: str | None = Header(None),
                           x_api_key: str | None = Header(None)) -> Response:
        session = await open_session(session_id, authorization, x_api_key)
        chat = anthropic_messages.parse_count_tokens(body)
        headers = ignored_tools_headers(session, chat)
        planned = await asyncio.to_thread(plan_turn, gateway.template.with_thinking(chat.thinking), store,
                                          session.spec.session_id, chat, settings.gateway.max_prompt_tokens)
        return JSONResponse(anthropic_messages.count_tokens_response(len(planned.prompt_ids)),
                            headers=headers)

    @app.get("/s/{session_id}/v1/models")
    async def models(session_id: str, authorization: str | None = Header(None), x_api_key: str | None = Header(None),
                     anthropic_version: str | None = Header(None)) -> dict[str, Any]:
        await open_session(session_id, authorization, x_api_key)
        name = settings.model.served_name
        if anthropic_version:
            return {"data": [{"type": "model", "id": name, "display_name": name,
                              "created_at": "1970-01-01T00:00:00Z"}], "has_more": False, "first_id": name,
                    "last_id": name}
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "rollstream"}]}

    @app.exception_handler(FleetUnavailable)
    async def no_server(request: Request, exc: FleetUnavailable) -> JSONResponse:
        return error_response(api_of(request.url.path), 503, f"no vLLM server can serve the turn: {exc}")

    @app.exception_handler(FleetRequestError)
    async def refused(request: Request, exc: FleetRequestError) -> JSONResponse:
        return error_response(api_of(request.url.path), 400, f"vLLM refused the turn: {exc}")

    @app.exception_handler(TemplateError)
    async def unrenderable(request: Request, exc: TemplateError) -> JSONResponse:
        return error_response(api_of(request.url.path), 400, f"the chat template cannot render this: {exc}")

    return app


def jsonable_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    return [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]


async def watch_event_loop() -> None:
    """The longest the loop was late to wake up: what a blocking call on it would cost every session."""
    longest = 0.0
    while True:
        before = time.monotonic()
        await asyncio.sleep(STALL_CHECK_S)
        late = time.monotonic() - before - STALL_CHECK_S
        if late > longest:
            longest = late
            LOOP_STALL.set(longest)


class _Server(uvicorn.Server):
    """The service runtime owns SIGTERM (drain, then exit), not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(settings: Settings, runtime: ServiceRuntime) -> None:
    from transformers import AutoTokenizer

    # Every turn hops to a thread for Redis and the template; the default pool (cores + 4) made turns queue.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=WORKER_THREADS,
                                                                       thread_name_prefix="gateway"))

    from rollstream.shared.inference.fleet import FleetClient

    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    tokenizer = AutoTokenizer.from_pretrained(settings.model.path)
    fleet = FleetClient(settings.fleet.urls, model=settings.model.served_name, timeout_s=settings.fleet.request_timeout_s)
    fleet.start_load_refresh(LOAD_REFRESH_S)

    async def versions() -> dict[str, int]:
        return await asyncio.to_thread(bus.fleet_versions)

    store = SessionStore(bus, settings.gateway.session_ttl_s, settings.gateway.finish_grace_s)
    gateway = Gateway(settings=settings, store=store, template=ChatTemplate(tokenizer), fleet=fleet,
                      versions=versions)
    app = build_app(gateway, runtime)
    # What start-up loaded (transformers, torch, the tokenizer: some 400k objects) lives as long as the process.
    # Left to the collector, each full collection walks all of it on the event loop (0.2 s on an idle core).
    gc.freeze()
    server = _Server(uvicorn.Config(app, host=settings.listen_host, port=settings.gateway.port, log_config=None,
                                    access_log=False, timeout_graceful_shutdown=30))
    watcher = asyncio.create_task(watch_event_loop())
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    runtime.not_ready = None
    runtime.status["url"] = settings.gateway.url
    while not runtime.stopping and not serving.done():
        await asyncio.sleep(0.2)
    server.should_exit = True
    await serving
    watcher.cancel()
    await fleet.aclose()


def main() -> None:
    settings = Settings()
    runtime = ServiceRuntime("gateway", settings)
    runtime.not_ready = "starting: loading the tokenizer, then the API server"
    asyncio.run(serve(settings, runtime))
    runtime.close()


if __name__ == "__main__":
    main()
