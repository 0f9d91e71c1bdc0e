"""FleetClient: token-in/token-out calls to a fleet of vLLM servers, session-sticky, plus weight sync.

Agent-runners call `complete()` with prompt token ids and get back the sampled token ids with their
logprobs, exactly as vLLM reported them: text is never re-tokenized (the token-exactness rule).

Routing: rendezvous hashing of the session id picks the same server for every turn of a session (its
prefix cache stays warm), with bounded load: a server already carrying more than (1 + epsilon) times the
average in-flight load is passed over for the session's next-ranked server. A connection error or a 5xx
marks a server unhealthy for a cool-down and the call is retried on the next server; when no server can
serve, FleetUnavailable. Every request carries `X-Session-ID` and `X-SMG-Routing-Key` so that an external
router (vllm-router, SGLang model gateway) in front of the fleet keeps the same stickiness.

The trainer / fleet controller uses the per-server helpers: `reload_weights()` (pause, reload from an HF
safetensors directory on the server's filesystem, reset the prefix cache, resume), `prompt_logprobs()`
(to check logprob parity after a reload) and `health()`. The server needs VLLM_SERVER_DEV_MODE=1.

Response fields used (vLLM 0.32, /v1/completions with `return_token_ids`, `logprobs: 0`):
    choices[0].token_ids                  [int, ...]          sampled ids
    choices[0].logprobs.token_logprobs    [float, ...]        one per sampled id
    choices[0].prompt_logprobs            [null, {"<id>": {"logprob": float, "rank": int,
                                                          "decoded_token": str}}, ...]
Library module, not run directly; `tests/integration/test_vllm_fleet.py` exercises it on a real server:
    python -m pytest tests/unit/shared/inference/test_fleet_routing.py tests/integration/test_vllm_fleet.py -q
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from rollstream.shared.errors import (
    FleetRequestError,
    FleetUnavailable,
    WeightSyncError,
)

SESSION_HEADERS = ("X-Session-ID", "X-SMG-Routing-Key")


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    # One per token id. vLLM's default logprobs_mode is raw_logprobs: the model's log-softmax BEFORE
    # temperature, logit_bias, top-k/p. That is the sampling distribution only at temperature 1 with no
    # other processing; otherwise start vLLM with --logprobs-mode processed_logprobs.
    logprobs: list[float]
    finish_reason: str  # "stop" (eos / stop token, which is included in token_ids) or "length"
    server_url: str


def _rank(session_id: str, url: str) -> int:
    """Rendezvous score; stable across processes (unlike hash()), so every replica routes alike."""
    digest = hashlib.blake2b(f"{url}\x00{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class FleetClient:
    """Async client over the vLLM servers at `urls`; one instance per process, shared by its tasks."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        model: str | None = None,
        epsilon: float = 0.25,
        cooldown_s: float = 10.0,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not urls:
            raise ValueError("FleetClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"duplicate server URLs: {self.urls}")
        self.model = model  # None: vLLM uses the one model it serves
        self.epsilon = epsilon
        self.cooldown_s = cooldown_s
        self.in_flight = {u: 0 for u in self.urls}
        self._unhealthy_until = {u: 0.0 for u in self.urls}
        self._http = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> FleetClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # -- health bookkeeping -------------------------------------------------------------------------
    def is_healthy(self, url: str) -> bool:
        return time.monotonic() >= self._unhealthy_until[url]

    def mark_unhealthy(self, url: str, cooldown_s: float | None = None) -> None:
        cooldown = self.cooldown_s if cooldown_s is None else cooldown_s
        self._unhealthy_until[url] = time.monotonic() + cooldown

    def mark_healthy(self, url: str) -> None:
        self._unhealthy_until[url] = 0.0

    # -- routing ------------------------------------------------------------------------------------
    def route(self, session_id: str) -> list[str]:
        """Healthy servers in the order this session should try them (first: the one to use now)."""
        healthy = [u for u in self.urls if self.is_healthy(u)]
        if not healthy:
            return []
        ranked = sorted(healthy, key=lambda u: _rank(session_id, u), reverse=True)
        # Bounded load: capacity is (1 + eps) x the average load including this request.
        total = sum(self.in_flight[u] for u in healthy) + 1
        capacity = math.ceil((1 + self.epsilon) * total / len(healthy))
        with_room = [u for u in ranked if self.in_flight[u] + 1 <= capacity]
        return with_room + [u for u in ranked if u not in with_room]

    # -- generation ---------------------------------------------------------------------------------
    async def complete(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        session_id: str,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Completion:
        """Sample up to max_tokens after prompt_ids on the session's server; ids and logprobs as vLLM gave them."""
        body: dict[str, Any] = {
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if self.model is not None:
            body["model"] = self.model
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        if seed is not None:
            body["seed"] = seed
        if extra:
            body.update(extra)
        headers = {name: session_id for name in SESSION_HEADERS}

        candidates = self.route(session_id)
        if not candidates:
            raise FleetUnavailable(f"all {len(self.urls)} servers are in their unhealthy cool-down")
        failures: list[str] = []
        for url in candidates:
            self.in_flight[url] += 1
            try:
                response = await self._http.post(f"{url}/v1/completions", json=body, headers=headers)
            except httpx.TransportError as exc:
                failures.append(f"{url}: {type(exc).__name__}: {exc}")
                self.mark_unhealthy(url)
                continue
            finally:
                self.in_flight[url] -= 1
            if response.status_code >= 500:
                failures.append(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
                self.mark_unhealthy(url)
                continue
            if response.status_code != 200:
                raise FleetRequestError(f"{url} rejected the request: HTTP {response.status_code}: {response.text}")
            return _parse_completion(response.json(), url)
        raise FleetUnavailable("no server could serve the request: " + "; ".join(failures))

    # -- per-server helpers for the trainer / fleet controller --------------------------------------
    async def health(self, url: str) -> bool:
        try:
            response = await self._http.get(f"{url.rstrip('/')}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def prompt_logprobs(self, url: str, prompt_ids: list[int]) -> list[float]:
        """logprob of prompt token i given tokens < i, for i = 1..n-1 (n-1 values) on server `url`."""
        body: dict[str, Any] = {"prompt": list(prompt_ids), "max_tokens": 1, "prompt_logprobs": 0}
        if self.model is not None:
            body["model"] = self.model
        response = await self._http.post(f"{url.rstrip('/')}/v1/completions", json=body)
        if response.status_code != 200:
            raise FleetRequestError(f"{url} prompt_logprobs: HTTP {response.status_code}: {response.text}")
        per_position = response.json()["choices"][0]["prompt_logprobs"]
        if per_position is None or len(per_position) != len(prompt_ids):
            raise FleetRequestError(f"{url} returned no prompt_logprobs for {len(prompt_ids)} prompt tokens")
        # Position 0 is null; position i maps str(token id) -> {"logprob", "rank", "decoded_token"}.
        return [float(entry[str(tok)]["logprob"]) for tok, entry in zip(prompt_ids[1:], per_position[1:])]

    async def reload_weights(self, url: str, weights_dir: str) -> None:
        """Pause `url`, load the HF safetensors checkpoint at weights_dir (a path on the server), resume.

        In-flight requests are kept (paused, not aborted) and go on with the new weights. A failed reload
        kills vLLM's engine (observed on vLLM 0.32: EngineDeadError, the server exits), so on failure the
        server is also marked unhealthy here and has to be restarted.
        """
        url = url.rstrip("/")
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}}
        await self._sync_step(url, "pause", "/pause", params={"mode": "keep"})
        try:
            await self._sync_step(url, "reload_weights", "/collective_rpc", json=rpc)
            await self._sync_step(url, "reset_prefix_cache", "/reset_prefix_cache")
        except BaseException as exc:
            if isinstance(exc, WeightSyncError):
                self.mark_unhealthy(url, cooldown_s=max(self.cooldown_s, 60.0))
            try:  # resume anyway; the first error is the one to report
                await self._sync_step(url, "resume", "/resume")
            except WeightSyncError:
                pass
            raise
        await self._sync_step(url, "resume", "/resume")

    async def _sync_step(self, url: str, step: str, path: str, **kwargs: Any) -> None:
        try:
            response = await self._http.post(f"{url}{path}", **kwargs)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{url}: {step} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise WeightSyncError(f"{url}: {step} failed: HTTP {response.status_code}: {response.text}")


def _parse_completion(body: dict[str, Any], url: str) -> Completion:
    try:
        choice = body["choices"][0]
        token_ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
        finish_reason = str(choice["finish_reason"])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise FleetRequestError(f"{url} answered without token ids / logprobs: {str(body)[:500]}") from exc
    if len(token_ids) != len(logprobs):
        raise FleetRequestError(f"{url} returned {len(token_ids)} token ids but {len(logprobs)} logprobs")
    return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason, server_url=url)
