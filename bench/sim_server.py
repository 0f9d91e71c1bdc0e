"""One simulated vLLM server of bench/sim_fleet.py, without its HTTP layer: what it answers to a
completion, a pause, a resume, a weight reload and a metrics scrape, on the latency model of
bench/sim_latency.py.

Sampled tokens are random ids in the vocabulary (ids with a logit_bias of -100 or lower are never drawn)
with a logprob near log(1/vocab), the value an untrained model gives; prompt logprobs are real
(bench/sim_checkpoints.py). Prompt tokens that extend the session's previous prompt and answer on the same
server are prefix-cached and cost nothing (reset by /reset_prefix_cache).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # run as a script: bench/ is first on sys.path
    from sim_checkpoints import Checkpoints
    from sim_latency import Engine, Job, LatencyModel
except ImportError:  # imported as bench.sim_server (the tests)
    from bench.sim_checkpoints import Checkpoints
    from bench.sim_latency import Engine, Job, LatencyModel

BANNED_BIAS = -100.0  # OpenAI's logit_bias floor: such tokens are never sampled
PREFIX_CACHE_SESSIONS = 4096


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


def server_spec(model_path: Path, served_name: str, max_model_len: int) -> tuple[ServerSpec, Any]:
    """What every server of a fleet serving this checkpoint shares, from its config.json, and its
    tokenizer (None without a tokenizer.json: texts are then left empty)."""
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
        prompt, max_tokens = self.admit(body)
        await self.resumed.wait()  # a paused server holds new requests until it resumes
        prompt_logprobs = None
        if body.get("prompt_logprobs") is not None:
            prompt_logprobs = await self.prompt_logprobs(prompt)
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
        choice = self.choice(body, prompt, prompt_logprobs, ids, logprobs, finish)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.spec.served_name, "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "total_tokens": len(prompt) + len(ids),
                          "prompt_tokens_details": {"cached_tokens": cached}}}

    def admit(self, body: dict[str, Any]) -> tuple[list[int], int]:
        """The prompt and max_tokens of a completion request, or the HttpError vLLM answers it with."""
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
            raise HttpError(400, f"This model's maximum context length is {spec.max_model_len} tokens. "
                                 f"However, you requested {len(prompt) + max_tokens} tokens "
                                 f"({len(prompt)} in the messages, {max_tokens} in the completion).")
        return prompt, max_tokens

    async def prompt_logprobs(self, prompt: list[int]) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's prompt_logprobs of the prompt under the checkpoint this server last loaded."""
        values = await asyncio.to_thread(self.checkpoints.prompt_logprobs, self.checkpoint, prompt)
        return [None] + [{str(tok): {"logprob": lp, "rank": rank, "decoded_token": self.token_text(tok)}}
                         for tok, (lp, rank) in zip(prompt[1:], values)]

    def choice(self, body: dict[str, Any], prompt: list[int], prompt_logprobs: list | None, ids: list[int],
               logprobs: list[float], finish: str) -> dict[str, Any]:
        """The completion's choice, with the logprobs and token ids the request asked for."""
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(ids, skip_special_tokens=bool(body.get("skip_special_tokens", True)))
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, "stop_reason": None,
                                  "prompt_logprobs": prompt_logprobs, "logprobs": None}
        if body.get("logprobs") is not None:
            strings = [self.token_text(t) for t in ids]
            choice["logprobs"] = {"text_offset": [], "token_logprobs": logprobs, "tokens": strings,
                                  "top_logprobs": [{s: lp} for s, lp in zip(strings, logprobs)]}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
            choice["prompt_token_ids"] = prompt
        return choice

    async def collective_rpc(self, body: dict[str, Any]) -> dict[str, Any]:
        method = body.get("method")
        if method != "reload_weights":
            raise HttpError(400, f"unsupported collective_rpc method {method!r} (the simulator knows "
                                 "reload_weights)")
        path = (body.get("kwargs") or {}).get("weights_path")
        if not path:
            raise HttpError(400, "reload_weights needs kwargs.weights_path")
        try:
            await asyncio.to_thread(self.checkpoints.model, str(path))
        except Exception as exc:  # vLLM answers a failed reload with a 500
            raise HttpError(500, f"reload_weights failed: {type(exc).__name__}: {exc}",
                            "InternalServerError") from exc
        if self.latency.reload_s > 0:
            await asyncio.sleep(self.latency.reload_s)
        self.checkpoint = str(path)
        self.counters.reloads += 1
        return {"results": [None]}
