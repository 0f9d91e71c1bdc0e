"""A simulated vLLM fleet: many servers in one process, each answering the HTTP API rollstream's fleet
client uses, with a latency model instead of a GPU. It lets the real pipeline (dispatcher,
agent-runners, reward, trainer) run against a fleet far larger than this machine could serve.

    python bench/sim_fleet.py --servers 64 --base-port 0 --model models/tiny-llama \
        [--decode-ms 25] [--prefill-ms 0.1] [--overhead-ms 2] [--batch 8] [--reload-s 0.05]

prints one line `SIM_FLEET_READY {"urls": [...]}` once every port listens, then serves until SIGTERM.
Importable: `SimFleet(...).start()` serves from a background thread (tests), `.stop()` ends it.

Latency model, per server: a request costs `overhead + uncached prompt tokens x prefill +
generated tokens x decode` seconds of work. Up to `batch` concurrent requests each progress at full
speed (continuous batching is free up to the batch size); beyond it the server's throughput is shared,
so every request progresses at batch/running. Prompt tokens that extend the session's previous
prompt and answer on the same server are prefix-cached and cost nothing (reset by
/reset_prefix_cache). While paused, requests freeze (pause mode `keep`, what weight sync uses).

Sampled tokens are random ids in the vocabulary (ids with a logit_bias of -100 or lower are never
drawn) with a logprob near log(1/vocab), the value an untrained model gives; prompt logprobs are real:
a float32 transformers forward pass of the checkpoint the server was last told to load, so the
trainer's parity check after a weight sync holds. Checkpoints and results are cached by path, so 64
servers share one copy.

Accounting, on GET /metrics in Prometheus text like vLLM: `vllm:num_requests_running`, the token
and request counters, and `sim:busy_seconds_total` (time with at least one request progressing),
`sim:running_seconds_total` (integral of the running count) and `sim:uptime_seconds`.

    python bench/sim_fleet.py --proxy-to http://127.0.0.1:8000

serves instead a metering pass-through proxy in front of a real vLLM server (MeteredProxy): the same
busy-time counters, from the completions in flight through it, on GET /meter/metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import sys
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

BANNED_BIAS = -100.0  # OpenAI's logit_bias floor: such tokens are never sampled
PREFIX_CACHE_SESSIONS = 4096
WORK_EPSILON = 1e-6


# ---------------------------------------------------------------------------------- latency model
@dataclass(frozen=True)
class LatencyModel:
    prefill_s_per_token: float = 0.0001
    decode_s_per_token: float = 0.025
    overhead_s: float = 0.002
    batch_size: int = 8
    reload_s: float = 0.05

    def work(self, uncached_prompt_tokens: int, generated_tokens: int) -> float:
        """Seconds the request takes when it runs within the batch size."""
        return (self.overhead_s + uncached_prompt_tokens * self.prefill_s_per_token
                + generated_tokens * self.decode_s_per_token)

    def rate(self, running: int) -> float:
        """Work-seconds each running request gets per second."""
        return 1.0 if running <= self.batch_size else self.batch_size / running


@dataclass(eq=False)
class Job:
    work: float
    remaining: float
    finished_at: float | None = None


class Engine:
    """The time accounting of one server, clock-free: callers pass `now`, so it is testable exactly."""

    def __init__(self, latency: LatencyModel, now: float = 0.0) -> None:
        self.latency = latency
        self.jobs: list[Job] = []
        self.paused = False
        self.started = now
        self.last = now
        self.busy_s = 0.0
        self.running_s = 0.0

    def advance(self, now: float) -> list[Job]:
        """Progress every job to `now`; returns (and drops) the ones that are done."""
        dt = max(0.0, now - self.last)
        self.last = max(self.last, now)
        if self.paused or not self.jobs or dt == 0.0:
            return []
        self.busy_s += dt
        self.running_s += dt * len(self.jobs)
        step = dt * self.latency.rate(len(self.jobs))
        done = []
        for job in self.jobs:
            job.remaining -= step
            if job.remaining <= WORK_EPSILON:
                job.finished_at = now
                done.append(job)
        if done:
            self.jobs = [job for job in self.jobs if job.finished_at is None]
        return done

    def submit(self, work: float, now: float) -> tuple[Job, list[Job]]:
        done = self.advance(now)
        job = Job(work=work, remaining=work)
        self.jobs.append(job)
        return job, done

    def remove(self, job: Job, now: float) -> list[Job]:
        done = self.advance(now)
        if job in self.jobs:
            self.jobs.remove(job)
        return done

    def pause(self, now: float) -> list[Job]:
        done = self.advance(now)
        self.paused = True
        return done

    def resume(self, now: float) -> None:
        self.last = max(self.last, now)  # the paused interval is neither busy nor progress
        self.paused = False

    def next_completion(self) -> float | None:
        """Absolute time the first running job finishes if nothing changes; None when none runs."""
        if self.paused or not self.jobs:
            return None
        return self.last + min(job.remaining for job in self.jobs) / self.latency.rate(len(self.jobs))


# -------------------------------------------------------------------------- checkpoints (shared)
class Checkpoints:
    """Models by checkpoint path and prompt logprobs by (path, ids): one copy for every server."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.load_lock = threading.Lock()
        self.models: OrderedDict[str, Any] = OrderedDict()
        self.results: OrderedDict[tuple[str, tuple[int, ...]], list[tuple[float, int]]] = OrderedDict()

    def model(self, path: str):
        # one loader at a time: concurrent first imports of transformers fail half-initialised, and a
        # checkpoint asked for by 64 servers at once is loaded once
        with self.load_lock:
            with self.lock:
                if path in self.models:
                    self.models.move_to_end(path)
                    return self.models[path]
            import torch
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            if not (Path(path) / "config.json").exists():
                raise FileNotFoundError(f"no HF checkpoint at {path}")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            with self.lock:
                self.models[path] = model
                while len(self.models) > 3:  # the trainer moves on; old versions are never asked again
                    self.models.popitem(last=False)
            return model

    def prompt_logprobs(self, path: str, ids: list[int]) -> list[tuple[float, int]]:
        """(logprob, rank) of ids[i] given ids[:i], i = 1..n-1, as the trainer computes them."""
        key = (path, tuple(ids))
        with self.lock:
            if key in self.results:
                return self.results[key]
        import torch

        model = self.model(path)
        tokens = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=tokens).logits.float()
        logp = torch.log_softmax(logits[0, :-1], dim=-1)
        chosen = logp.gather(-1, tokens[0, 1:, None])
        ranks = (logp > chosen).sum(dim=-1) + 1
        result = list(zip(chosen[:, 0].tolist(), ranks.tolist()))
        with self.lock:
            self.results[key] = result
            while len(self.results) > 256:
                self.results.popitem(last=False)
        return result


# ----------------------------------------------------------------------------------- one server
class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


@dataclass
class Counters:
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    reloads: int = 0


@dataclass
class ServerSpec:
    model_path: str
    served_name: str
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None


class SimServer:
    """One simulated vLLM server; lives on an asyncio loop."""

    def __init__(self, index: int, spec: ServerSpec, latency: LatencyModel, checkpoints: Checkpoints,
                 tokenizer=None, seed: int = 0) -> None:
        self.index = index
        self.spec = spec
        self.latency = latency
        self.checkpoints = checkpoints
        self.tokenizer = tokenizer
        self.checkpoint = spec.model_path
        self.rng = random.Random(f"{seed}:{index}")
        self.loop = asyncio.get_running_loop()
        self.engine = Engine(latency, self.loop.time())
        self.futures: dict[Job, asyncio.Future] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.prefix: OrderedDict[str, list[int]] = OrderedDict()
        self.counters = Counters()

    # -- scheduling ------------------------------------------------------------------------------
    def _settle(self, done: list[Job]) -> None:
        for job in done:
            future = self.futures.pop(job, None)
            if future is not None and not future.done():
                future.set_result(1.0)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        when = self.engine.next_completion()
        if when is not None:
            self.timer = self.loop.call_at(when, self._tick)

    def _tick(self) -> None:
        self.timer = None
        self._settle(self.engine.advance(self.loop.time()))

    async def run_job(self, work: float) -> float:
        """Hold the caller for the job's simulated time; returns the fraction done (1.0 unless aborted)."""
        job, done = self.engine.submit(work, self.loop.time())
        future = self.loop.create_future()
        self.futures[job] = future
        self._settle(done)
        try:
            return await future
        except asyncio.CancelledError:
            self._settle(self.engine.remove(job, self.loop.time()))
            self.futures.pop(job, None)
            raise

    async def pause(self, mode: str) -> None:
        if mode == "wait":
            while self.engine.jobs:
                await asyncio.sleep(0.01)
        done = self.engine.pause(self.loop.time())
        self.resumed.clear()
        self._settle(done)
        if mode == "abort":
            for job in list(self.engine.jobs):
                self.engine.remove(job, self.loop.time())
                future = self.futures.pop(job, None)
                if future is not None and not future.done():
                    future.set_result(max(0.0, 1.0 - job.remaining / job.work) if job.work else 1.0)

    def resume(self) -> None:
        self.engine.resume(self.loop.time())
        self.resumed.set()
        self._settle([])

    def metrics(self) -> str:
        self._settle(self.engine.advance(self.loop.time()))
        engine, c, label = self.engine, self.counters, f'{{model_name="{self.spec.served_name}"}}'
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {0 if engine.paused else len(engine.jobs)}.0",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} {len(engine.jobs) if engine.paused else 0}.0",
            "# TYPE vllm:request_success_total counter",
            f"vllm:request_success_total{label} {c.requests}.0",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{label} {c.prompt_tokens}.0",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{label} {c.cached_prompt_tokens}.0",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{label} {c.generation_tokens}.0",
            "# TYPE sim:busy_seconds_total counter",
            f"sim:busy_seconds_total{label} {engine.busy_s!r}",
            "# TYPE sim:running_seconds_total counter",
            f"sim:running_seconds_total{label} {engine.running_s!r}",
            "# TYPE sim:uptime_seconds gauge",
            f"sim:uptime_seconds{label} {self.loop.time() - engine.started!r}",
            "# TYPE sim:weight_reloads_total counter",
            f"sim:weight_reloads_total{label} {c.reloads}.0",
        ]
        return "\n".join(lines) + "\n"

    # -- prefix cache ----------------------------------------------------------------------------
    def cached_tokens(self, session: str | None, prompt: list[int]) -> int:
        if not session or session not in self.prefix:
            return 0
        previous = self.prefix[session]
        self.prefix.move_to_end(session)
        limit = min(len(previous), len(prompt) - 1)  # the last prompt token is always computed
        n = 0
        while n < limit and previous[n] == prompt[n]:
            n += 1
        return n

    def remember(self, session: str | None, tokens: list[int]) -> None:
        if not session:
            return
        self.prefix[session] = tokens
        self.prefix.move_to_end(session)
        while len(self.prefix) > PREFIX_CACHE_SESSIONS:
            self.prefix.popitem(last=False)

    # -- sampling --------------------------------------------------------------------------------
    def sample(self, body: dict[str, Any], max_tokens: int) -> tuple[list[int], list[float], str]:
        rng = random.Random(body["seed"]) if body.get("seed") is not None else self.rng
        banned = {int(k) for k, v in (body.get("logit_bias") or {}).items() if float(v) <= BANNED_BIAS}
        vocab = self.spec.vocab_size
        allowed = [i for i in range(vocab) if i not in banned] if banned else None
        stops = {int(t) for t in body.get("stop_token_ids") or []}
        if self.spec.eos_token_id is not None and not body.get("ignore_eos", False):
            stops.add(self.spec.eos_token_id)
        stops -= banned
        base = -math.log(vocab)
        ids: list[int] = []
        logprobs: list[float] = []
        for _ in range(max_tokens):
            token = rng.choice(allowed) if allowed is not None else rng.randrange(vocab)
            ids.append(token)
            logprobs.append(min(0.0, rng.gauss(base, 0.3)))
            if token in stops:
                return ids, logprobs, "stop"
        return ids, logprobs, "length"

    def token_text(self, token: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)

    # -- endpoints -------------------------------------------------------------------------------
    async def completions(self, body: dict[str, Any], session: str | None) -> dict[str, Any]:
        spec = self.spec
        if body.get("model") not in (None, spec.served_name):
            raise HttpError(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            raise HttpError(400, "this server takes token ids: prompt must be a non-empty list of ints")
        if any(t < 0 or t >= spec.vocab_size for t in prompt):
            raise HttpError(400, f"prompt token id out of vocabulary (size {spec.vocab_size})")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise HttpError(400, "max_tokens must be at least 1")
        if len(prompt) + max_tokens > spec.max_model_len:
            raise HttpError(400, f"This model's maximum context length is {spec.max_model_len} tokens. However, you "
                                 f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
                                 f"{max_tokens} in the completion).")
        await self.resumed.wait()  # a paused server holds new requests until it resumes
        prompt_logprobs = None
        if body.get("prompt_logprobs") is not None:
            values = await asyncio.to_thread(self.checkpoints.prompt_logprobs, self.checkpoint, prompt)
            prompt_logprobs = [None] + [{str(tok): {"logprob": lp, "rank": rank, "decoded_token": self.token_text(tok)}}
                                        for tok, (lp, rank) in zip(prompt[1:], values)]
        cached = self.cached_tokens(session, prompt)
        ids, logprobs, finish = self.sample(body, max_tokens)
        done = await self.run_job(self.latency.work(len(prompt) - cached, len(ids)))
        if done < 1.0:  # aborted by a pause: only what was decoded so far comes back
            kept = int(len(ids) * done)
            ids, logprobs, finish = ids[:kept], logprobs[:kept], "abort"
        self.remember(session, prompt + ids)
        c = self.counters
        c.requests += 1
        c.prompt_tokens += len(prompt)
        c.cached_prompt_tokens += cached
        c.generation_tokens += len(ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=bool(body.get("skip_special_tokens", True))) \
            if self.tokenizer is not None else ""
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, "stop_reason": None,
                                  "prompt_logprobs": prompt_logprobs, "logprobs": None}
        if body.get("logprobs") is not None:
            strings = [self.token_text(t) for t in ids]
            choice["logprobs"] = {"text_offset": [], "token_logprobs": logprobs, "tokens": strings,
                                  "top_logprobs": [{s: lp} for s, lp in zip(strings, logprobs)]}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
            choice["prompt_token_ids"] = prompt
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": spec.served_name, "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "total_tokens": len(prompt) + len(ids),
                          "prompt_tokens_details": {"cached_tokens": cached}}}

    async def collective_rpc(self, body: dict[str, Any]) -> dict[str, Any]:
        method = body.get("method")
        if method != "reload_weights":
            raise HttpError(400, f"unsupported collective_rpc method {method!r} (the simulator knows reload_weights)")
        path = (body.get("kwargs") or {}).get("weights_path")
        if not path:
            raise HttpError(400, "reload_weights needs kwargs.weights_path")
        try:
            await asyncio.to_thread(self.checkpoints.model, str(path))
        except Exception as exc:  # vLLM answers a failed reload with a 500
            raise HttpError(500, f"reload_weights failed: {type(exc).__name__}: {exc}", "InternalServerError") from exc
        if self.latency.reload_s > 0:
            await asyncio.sleep(self.latency.reload_s)
        self.checkpoint = str(path)
        self.counters.reloads += 1
        return {"results": [None]}


# ------------------------------------------------------------------------------------- the fleet
def _server_spec(model_path: Path, served_name: str, max_model_len: int) -> tuple[ServerSpec, Any]:
    config = json.loads((model_path / "config.json").read_text())
    tokenizer = None
    if (model_path / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    spec = ServerSpec(model_path=str(model_path.resolve()), served_name=served_name,
                      vocab_size=int(config["vocab_size"]), max_model_len=max_model_len, eos_token_id=eos)
    return spec, tokenizer


def _build_app(servers: dict[int, SimServer]):
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    def server_of(request: Request) -> SimServer:
        return servers[request.scope["server"][1]]

    def error(exc: HttpError) -> Response:
        return JSONResponse({"error": {"message": str(exc), "type": exc.kind, "code": exc.status}},
                            status_code=exc.status)

    async def completions(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as exc:
            return error(HttpError(400, f"body is not JSON: {exc}"))
        except ClientDisconnect:  # the caller gave up (timeout, shutdown): nothing to answer
            return Response(status_code=499)
        try:
            result = await server_of(request).completions(body, request.headers.get("x-session-id"))
        except HttpError as exc:
            return error(exc)
        return Response(msgspec.json.encode(result), media_type="application/json")

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        name = server_of(request).spec.served_name
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "sim"}]})

    async def pause(request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return error(HttpError(400, f"unknown pause mode {mode!r}"))
        await server_of(request).pause(mode)
        return JSONResponse({"status": "paused"})

    async def resume(request: Request) -> Response:
        server_of(request).resume()
        return JSONResponse({"status": "resumed"})

    async def is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": server_of(request).engine.paused})

    async def reset_prefix_cache(request: Request) -> Response:
        server_of(request).prefix.clear()
        return Response(status_code=200)

    async def collective_rpc(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body())
            return JSONResponse(await server_of(request).collective_rpc(body))
        except msgspec.DecodeError as exc:
            return error(HttpError(400, f"body is not JSON: {exc}"))
        except HttpError as exc:
            return error(exc)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(server_of(request).metrics(), media_type="text/plain; version=0.0.4")

    return Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/pause", pause, methods=["POST"]),
        Route("/resume", resume, methods=["POST"]),
        Route("/is_paused", is_paused, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/collective_rpc", collective_rpc, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ])


def _listen(host: str, port: int) -> socket.socket:
    # proto given explicitly: asyncio turns Nagle off only on sockets whose proto is IPPROTO_TCP, and
    # with Nagle on, a response written as headers then body waits ~40 ms for the client's delayed ACK
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class _Host:
    """Serves one ASGI app on a set of listening sockets, from a background thread or in a loop."""

    def __init__(self, ports: list[int], host: str) -> None:
        self.host = host
        self.sockets = [_listen(host, port) for port in ports]
        self.ports = [s.getsockname()[1] for s in self.sockets]
        self._uvicorn = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{port}" for port in self.ports]

    def build_app(self):
        raise NotImplementedError

    async def serve(self) -> None:
        import uvicorn

        # keep-alive longer than any client's idle gap: a server closing a pooled connection while the
        # client reuses it fails that request, which the fleet client would count against the server
        config = uvicorn.Config(self.build_app(), lifespan="off", log_level="warning", access_log=False,
                                http="httptools", timeout_keep_alive=300, backlog=1024)
        self._uvicorn = uvicorn.Server(config)
        serving = asyncio.create_task(self._uvicorn.serve(sockets=self.sockets))
        while not self._uvicorn.started and not serving.done():
            await asyncio.sleep(0.01)
        self._ready.set()
        try:
            await serving
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Release what the app holds, once the server has stopped."""

    def start(self, timeout_s: float = 60.0):
        def run() -> None:
            try:
                asyncio.run(self.serve())
            except BaseException as exc:  # surfaced by start()
                self._error = exc
                self._ready.set()

        self._thread = threading.Thread(target=run, name=type(self).__name__, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"{type(self).__name__} did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        for sock in self.sockets:
            sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SimFleet(_Host):
    """`servers` simulated vLLM servers on consecutive ports from `base_port` (0: any free ports)."""

    def __init__(self, model_path: Path | str, servers: int = 1, *, base_port: int = 0, host: str = "127.0.0.1",
                 served_name: str = "tiny", latency: LatencyModel | None = None, max_model_len: int = 1024,
                 seed: int = 0) -> None:
        super().__init__([base_port + i if base_port else 0 for i in range(servers)], host)
        self.model_path = Path(model_path)
        self.served_name = served_name
        self.latency = latency or LatencyModel()
        self.max_model_len = max_model_len
        self.seed = seed
        self.servers: dict[int, SimServer] = {}
        self.checkpoints = Checkpoints()

    def build_app(self):
        spec, tokenizer = _server_spec(self.model_path, self.served_name, self.max_model_len)
        for index, port in enumerate(self.ports):
            self.servers[port] = SimServer(index, spec, self.latency, self.checkpoints, tokenizer, self.seed)
        return _build_app(self.servers)


# ---------------------------------------------------------------------- metering a real server
class InFlightMeter:
    """Busy time of a server seen from in front of it: time with a completion in flight, not paused."""

    def __init__(self, now: float) -> None:
        self.started = self.last = now
        self.in_flight = 0
        self.paused = False
        self.busy_s = 0.0
        self.running_s = 0.0

    def advance(self, now: float) -> None:
        dt = max(0.0, now - self.last)
        self.last = max(self.last, now)
        if self.in_flight and not self.paused:
            self.busy_s += dt
            self.running_s += dt * self.in_flight

    def enter(self, now: float) -> None:
        self.advance(now)
        self.in_flight += 1

    def leave(self, now: float) -> None:
        self.advance(now)
        self.in_flight -= 1

    def pause(self, now: float) -> None:
        self.advance(now)
        self.paused = True

    def resume(self, now: float) -> None:
        self.advance(now)
        self.paused = False

    def metrics(self, now: float) -> str:
        self.advance(now)
        return "\n".join([
            "# TYPE sim:in_flight_requests gauge",
            f"sim:in_flight_requests {self.in_flight}.0",
            "# TYPE sim:busy_seconds_total counter",
            f"sim:busy_seconds_total {self.busy_s!r}",
            "# TYPE sim:running_seconds_total counter",
            f"sim:running_seconds_total {self.running_s!r}",
            "# TYPE sim:uptime_seconds gauge",
            f"sim:uptime_seconds {now - self.started!r}",
        ]) + "\n"


PROXIED_HEADERS = ("content-type", "accept", "x-session-id", "x-smg-routing-key", "authorization")


class MeteredProxy(_Host):
    """A pass-through proxy in front of one real server that meters its busy time the way the simulated
    servers count theirs; GET /meter/metrics reports it, every other path is forwarded.

    vLLM's own vllm:num_requests_running cannot stand in for it on a CPU server: /metrics is answered by
    the same event loop that streams the engine's outputs, so a scrape is served mostly between
    requests and short requests are almost never seen running."""

    METRICS_PATH = "/meter/metrics"

    def __init__(self, upstream: str, *, port: int = 0, host: str = "127.0.0.1") -> None:
        super().__init__([port], host)
        self.upstream = upstream.rstrip("/")
        self.meter: InFlightMeter | None = None
        self.session = None

    def build_app(self):
        import aiohttp
        from starlette.applications import Starlette
        from starlette.requests import ClientDisconnect, Request
        from starlette.responses import PlainTextResponse, Response
        from starlette.routing import Route

        loop = asyncio.get_running_loop()
        self.meter = meter = InFlightMeter(loop.time())

        async def forward(request: Request) -> Response:
            path = request.url.path
            if path == self.METRICS_PATH:
                return PlainTextResponse(meter.metrics(loop.time()), media_type="text/plain; version=0.0.4")
            if self.session is None:
                self.session = aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=None),
                    connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=300))
            try:
                body = await request.body()
            except ClientDisconnect:
                return Response(status_code=499)
            headers = {k: v for k, v in request.headers.items() if k in PROXIED_HEADERS}
            completion = path == "/v1/completions"
            if completion:
                meter.enter(loop.time())
            try:
                async with self.session.request(request.method, self.upstream + path, params=request.query_params,
                                                data=body, headers=headers) as upstream:
                    content = await upstream.read()
                    status, media_type = upstream.status, upstream.headers.get("content-type")
            except aiohttp.ClientError as exc:
                return PlainTextResponse(f"upstream {self.upstream}: {type(exc).__name__}: {exc}", status_code=502)
            finally:
                if completion:
                    meter.leave(loop.time())
            if status == 200 and path == "/pause":
                meter.pause(loop.time())
            elif status == 200 and path == "/resume":
                meter.resume(loop.time())
            return Response(content, status_code=status, media_type=media_type)

        return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "PUT", "DELETE"])])

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name without labels: value}, summed over label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=64)
    parser.add_argument("--base-port", type=int, default=0, help="first port; 0: any free ports")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", type=Path, default=Path("models/tiny-llama"))
    parser.add_argument("--served-name", default="tiny")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--prefill-ms", type=float, default=0.1, help="per uncached prompt token")
    parser.add_argument("--decode-ms", type=float, default=25.0, help="per generated token")
    parser.add_argument("--overhead-ms", type=float, default=2.0, help="per request")
    parser.add_argument("--batch", type=int, default=8, help="requests per server that run at full speed")
    parser.add_argument("--reload-s", type=float, default=0.05, help="time a weight reload takes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--proxy-to", metavar="URL", help="instead: meter a real server (MeteredProxy) on one port")
    args = parser.parse_args()
    if args.proxy_to:
        host: _Host = MeteredProxy(args.proxy_to, port=args.base_port, host=args.host)
    else:
        latency = LatencyModel(prefill_s_per_token=args.prefill_ms / 1000, decode_s_per_token=args.decode_ms / 1000,
                               overhead_s=args.overhead_ms / 1000, batch_size=args.batch, reload_s=args.reload_s)
        host = SimFleet(args.model, args.servers, base_port=args.base_port, host=args.host,
                        served_name=args.served_name, latency=latency, max_model_len=args.max_model_len, seed=args.seed)

    async def run() -> None:
        serving = asyncio.create_task(host.serve())
        while not host._ready.is_set() and not serving.done():
            await asyncio.sleep(0.01)
        if not serving.done():
            print("SIM_FLEET_READY " + json.dumps({"urls": host.urls}), flush=True)
        await serving

    try:
        import uvloop

        uvloop.run(run())
    except ImportError:
        asyncio.run(run())
    sys.exit(0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # prompt logprobs are tiny forward passes: the cores are the pipeline's
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
