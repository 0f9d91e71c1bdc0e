"""The per-server calls the trainer makes through the fleet client (FleetClient inherits them): a server's
health, its prompt logprobs (the parity probe after a weight sync), a reload from a checkpoint, a LoRA
adapter loaded in place, and one step of a weight update (shared/inference/weight_transport.py drives those).
The servers need VLLM_SERVER_DEV_MODE=1 (and, for adapters, VLLM_ALLOW_RUNTIME_LORA_UPDATING).

Library module; the integration tests run it on real servers:
    python -m pytest tests/integration/test_vllm_fleet.py tests/integration/test_collective_weight_sync.py -q
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from rollstream.shared.errors import FleetRequestError, WeightSyncError
from rollstream.shared.inference.fleet_servers import MODELS_TIMEOUT_S, ServerNotMet, model_cards

if TYPE_CHECKING:
    from rollstream.shared.inference.fleet_servers import FleetServers


class ServerControl:
    """What FleetClient provides for these calls: its HTTP client, the model it asks for, its servers."""

    _http: httpx.AsyncClient
    model: str | None
    servers: FleetServers

    async def health(self, url: str) -> bool:
        try:
            response = await self._http.get(f"{url.rstrip('/')}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def prompt_logprobs(self, url: str, prompt_ids: list[int], model: str | None = None) -> list[float]:
        """logprob of prompt token i given tokens < i, for i = 1..n-1 (n-1 values) on server `url`, of the
        client's model or `model` (an adapter)."""
        body: dict[str, Any] = {"prompt": list(prompt_ids), "max_tokens": 1, "prompt_logprobs": 0}
        if model is not None or self.model is not None:
            body["model"] = model if model is not None else self.model
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
        await self.weight_step(url, "pause", "/pause", params={"mode": "keep"})
        try:
            await self.weight_step(url, "reload_weights", "/collective_rpc", json=rpc)
            await self.weight_step(url, "reset_prefix_cache", "/reset_prefix_cache")
        except BaseException as exc:
            if isinstance(exc, WeightSyncError):
                self.servers.mark_unhealthy(url, cooldown_s=max(self.servers.cooldown_s, 60.0))
            try:  # resume anyway; the first error is the one to report
                await self.weight_step(url, "resume", "/resume")
            except WeightSyncError:
                pass
            raise
        await self.weight_step(url, "resume", "/resume")

    async def load_adapter(self, url: str, name: str, adapter_dir: str) -> None:
        """Make `url` serve the LoRA adapter at adapter_dir (a peft directory, a path on the server) as model
        `name`, in place of the one it served under that name: requests under way go on with the new one from
        their next token. WeightSyncError when it does not (a server started without --enable-lora says
        so)."""
        body = {"lora_name": name, "lora_path": adapter_dir, "load_inplace": True}
        await self.weight_step(url.rstrip("/"), f"load adapter {name!r}", "/v1/load_lora_adapter", json=body)

    async def served_adapters(self, url: str) -> dict[str, str]:
        """The LoRA adapters `url` serves: name -> the directory it loaded it from (its GET /v1/models).
        A server that restarted serves none of those it was given before; each version of an adapter has a
        directory of its own, so the directory says which version it serves. WeightSyncError when it does not
        answer."""
        try:
            response = await self._http.get(f"{url.rstrip('/')}/v1/models", timeout=MODELS_TIMEOUT_S)
            cards = model_cards(response, url)
        except (httpx.HTTPError, ServerNotMet) as exc:
            raise WeightSyncError(f"{url}: cannot read the adapters it serves: {exc}") from exc
        return {name: str(card.get("root")) for name, card in cards.items() if card.get("parent")}

    async def weight_step(self, url: str, step: str, path: str, **kwargs: Any) -> None:
        """POST one step of a weight update to `url`; WeightSyncError when it fails."""
        try:
            response = await self._http.post(f"{url}{path}", **kwargs)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{url}: {step} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise WeightSyncError(f"{url}: {step} failed: HTTP {response.status_code}: {response.text}")
