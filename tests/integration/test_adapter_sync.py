"""Two LoRA adapters live on one real vLLM CPU server, as a LoRA run's fleet serves its roles: each is loaded
in place from the directory of its version (shared/inference/adapter_sync.py), probed for parity under its own
name, and a turn sampled under one adapter is token-exact against peft's logprobs of the same adapter at the
same version, while the other adapter and the base model serve on beside it.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from rollstream.cli.vllm_server import VllmServer, lora_arguments, policy_adapters
from rollstream.shared.errors import FleetUnavailable
from rollstream.shared.inference.adapter_sync import (
    AdapterUpdate,
    adapter_dir,
    newest_adapters,
    sync_adapters,
)
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.runtime.config import Settings
from tests.support import free_port

pytestmark = pytest.mark.integration

ROLES = ("planner", "solver")
PROBE = tuple(range(3, 40))
TOLERANCE = 1e-3


def lora_settings(tiny_model: Path, storage: Path) -> Settings:
    return Settings(run_id="lora", storage_uri=str(storage), model={"path": tiny_model, "max_model_len": 256},
                    roles={"names": {role: {} for role in ROLES}}, train={"lora_rank": 8})


@pytest.fixture(scope="module")
def peft_model(tiny_model):
    """The tiny model with an adapter per role, as the trainer makes them (B moved off zero, so that each
    adapter's logprobs differ from the base model's and from each other's)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=Settings().train.lora_target_modules)
    model = get_peft_model(base, config, adapter_name=ROLES[0])
    model.add_adapter(ROLES[1], config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    return model.eval()


def peft_logprobs(model, role: str | None, ids: list[int]) -> list[float]:
    """The trainer's logprob of each of `ids` after the first, with `role`'s adapter (None: the base)."""
    import contextlib

    import torch

    if role is not None:
        model.set_adapter(role)
    with torch.no_grad(), model.disable_adapter() if role is None else contextlib.nullcontext():
        logits = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [logits[i - 1, ids[i]].item() for i in range(1, len(ids))]


def save_version(model, run_dir: Path, role: str, version: int) -> AdapterUpdate:
    """The role's adapter written where the trainer writes that version of it, with its probe."""
    directory = adapter_dir(run_dir, role, version)
    saving = directory.parent / "saving"
    shutil.rmtree(saving, ignore_errors=True)
    model.save_pretrained(saving, selected_adapters=[role])
    shutil.rmtree(directory, ignore_errors=True)
    (saving / role).rename(directory)
    return AdapterUpdate(role, version, directory, PROBE, tuple(peft_logprobs(model, role, list(PROBE))))


@pytest.fixture(scope="module")
def lora_server(tiny_model, peft_model, tmp_path_factory):
    """A policy server of a LoRA run started after the planner's v0 was written: it serves that adapter from
    its start (lora_arguments), the solver not until a sync loads it."""
    storage = tmp_path_factory.mktemp("storage")
    settings = lora_settings(tiny_model, storage)
    save_version(peft_model, settings.run_dir(), "planner", 0)
    server = VllmServer.for_run(settings, tiny_model, free_port(), log_path=storage / "vllm.log")
    with server:
        server.wait_healthy(timeout_s=600)
        yield settings, server


def test_a_server_of_a_lora_run_starts_with_the_roles_newest_adapters(lora_server):
    settings, server = lora_server
    arguments = lora_arguments(settings, policy_adapters(settings))
    assert arguments[:6] == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules"]
    assert newest_adapters(settings.run_dir(), ROLES) == {
        "planner": (adapter_dir(settings.run_dir(), "planner", 0), 0)}
    assert server.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # what it serves, as the fleet's versions record it: the planner's v0 beside the policy's version
    assert server.version_fields(3) == {server.url: 3, f"planner@{server.url}": 0}


def test_adapters_load_in_place_by_version_and_serve_token_exact_turns(lora_server, peft_model):
    import torch

    settings, server = lora_server
    run_dir = settings.run_dir()

    async def scenario() -> None:
        async with FleetClient([server.url], model="tiny") as fleet:
            # a server without the solver's adapter sends a request for it nowhere: the caller waits, the
            # server stays healthy for the roles it serves
            with pytest.raises(FleetUnavailable, match="does not serve adapter 'solver' yet"):
                await fleet.complete(list(PROBE), max_tokens=4, session_id="s", model="solver")
            assert fleet.is_healthy(server.url)

            updates = [save_version(peft_model, run_dir, "planner", 0), save_version(peft_model, run_dir,
                                                                                       "solver", 0)]
            report = await sync_adapters(fleet, [server.url], updates)
            assert report.serving == [server.url] and not report.failures
            assert report.loaded == {server.url: ["solver"]}  # the planner's v0 it started with
            assert report.diffs[server.url] <= TOLERANCE
            assert report.bytes_sent == updates[1].size > 0

            # a step of the planner alone: only its new version moves
            with torch.no_grad():
                for name, parameter in peft_model.named_parameters():
                    if "lora_B" in name and ".planner" in name:
                        parameter.add_(0.02)
            planner_v1 = save_version(peft_model, run_dir, "planner", 1)
            report = await sync_adapters(fleet, [server.url], [planner_v1, updates[1]])
            assert report.loaded == {server.url: ["planner"]}
            assert report.diffs[server.url] <= TOLERANCE
            assert await fleet.served_adapters(server.url) == {"planner": str(planner_v1.path),
                                                                "solver": str(updates[1].path)}

            # each turn, sampled under its adapter at its version, is the trainer's within the tolerance;
            # the base model serves on unchanged beside them
            for role in ROLES:
                completion = await fleet.complete(list(PROBE), max_tokens=12, temperature=1.0,
                                                  session_id=f"turn-{role}", model=role, seed=7)
                sequence = [*PROBE, *completion.token_ids]
                trainer = peft_logprobs(peft_model, role, sequence)[len(PROBE) - 1:]
                assert max(abs(a - b) for a, b in zip(completion.logprobs, trainer, strict=True)) <= TOLERANCE
            base = peft_logprobs(peft_model, None, list(PROBE))
            served_base = await fleet.prompt_logprobs(server.url, list(PROBE))
            assert max(abs(a - b) for a, b in zip(served_base, base, strict=True)) <= TOLERANCE
            solver = await fleet.prompt_logprobs(server.url, list(PROBE), model="solver")
            assert max(abs(a - b) for a, b in zip(solver, base, strict=True)) > 10 * TOLERANCE

    asyncio.run(scenario())


def test_each_adapters_parity_probe_is_right_while_the_server_generates_for_both(lora_server, peft_model):
    """A probe's prompt logprobs under an adapter, asked while the server samples turns of both adapters and
    of the base model: vLLM's CPU build computed the output head's LoRA share of those rows with the indices
    of the sampled requests and died on the shapes (shared/inference/vllm_lora_logits.py). Each probe is the
    trainer's, and the server answers on."""
    settings, server = lora_server
    updates = [save_version(peft_model, settings.run_dir(), role, 5) for role in ROLES]

    async def scenario() -> None:
        async with FleetClient([server.url], model="tiny") as fleet:
            await sync_adapters(fleet, [server.url], updates)

            async def turn(model: str | None, index: int):
                return await fleet.complete(list(PROBE[:5 + index]), max_tokens=24, temperature=1.0,
                                            session_id=f"busy-{index}", model=model)

            async def probe(update: AdapterUpdate) -> float:
                served = await fleet.prompt_logprobs(server.url, list(update.probe), model=update.role)
                return max(abs(a - b) for a, b in zip(served, update.expected, strict=True))

            for _ in range(3):
                results = await asyncio.gather(
                    *(turn(model, i) for i, model in enumerate(["planner", "solver", None, "planner"])),
                    *(probe(update) for update in updates))
                assert all(diff <= TOLERANCE for diff in results[4:]), results[4:]
            assert await fleet.health(server.url)

    asyncio.run(scenario())
