"""The trainer of a LoRA run with several roles (services/trainer/training.py, train.lora_rank > 0): each
role's adapter learns from its role's rows alone, with an optimizer of its own; each role has its own version,
which grows only with a batch that trained it and by which its rows' staleness is judged; rows of a frozen
role or of a role the run does not have are left out with their reason; a restart from a checkpoint takes up
every adapter, its optimizer and the roles' versions exactly. Each published version of a role's adapter is
written for the servers in peft's format, at a directory of its own.

Real torch and peft on the tiny model, the real Redis (the `policy` stream, FLEET_VERSIONS); no fleet (the
sync with a real vLLM server: tests/integration/test_lora_trainer.py).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path

import torch

from rollstream.services.trainer.publishing import publish_update
from rollstream.services.trainer.role_versions import starting_role_versions
from rollstream.services.trainer.training import Trainer
from rollstream.shared.contract.batches import BatchRow, write_batch
from rollstream.shared.contract.events import BatchReady, PolicyUpdated
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.contract.run_facts import FLEET_VERSIONS
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage

ROLES = {"planner": {}, "solver": {}, "judge": {"trained": False}}


def lora_settings(storage: Path, model: Path, run_id: str, **train) -> Settings:
    return Settings(run_id=run_id, storage_uri=str(storage), model={"path": str(model)}, fleet={"urls": []},
                    roles={"names": ROLES},
                    train={"lora_rank": 8, "lora_alpha": 16, "trackers": [], "learning_rate": 1e-3,
                           "max_staleness": 1, **train})


def row(rollout: str, role: str | None, seed: int, version: int = 0, sampled: int = 6,
        advantage: float = 1.0) -> BatchRow:
    rng = random.Random(seed)
    length = rng.randint(16, 28)
    mask = [0] * (length - sampled) + [1] * sampled
    tokens = [rng.randrange(1, 352) for _ in range(length)]
    return BatchRow(sample_index=seed, trajectory_id=rollout, rollout_id=rollout, group_id="g0",
                    session_id=rollout, segment_index=0, tokens=tokens, response_length=sampled,
                    loss_mask=mask,
                    rollout_logprobs=[rng.uniform(-7.0, -4.0) if m else 0.0 for m in mask],
                    turn_policy_versions=[version], status="completed", reward=advantage, advantage=advantage,
                    role=role)


class Run:
    """A trainer of a LoRA run with its storage and bus; batches go through train_step as the service's do."""

    def __init__(self, settings: Settings, bus, start: PolicyUpdated | None = None) -> None:
        self.settings, self.bus = settings, bus
        self.storage = Storage(settings.storage_uri)
        self.trainer = Trainer(settings, self.storage, start, bus=bus)
        self.batches = 0

    def batch(self, rows: list[BatchRow]) -> BatchReady:
        self.batches += 1
        batch_id = f"b{self.batches:03d}-{id(self)}"
        uri = write_batch(self.storage, self.settings.run_id, batch_id, rows)
        return BatchReady(batch_id=batch_id, uri=uri, sample_count=len(rows), group_ids=["g0"],
                          min_policy_version=0, mean_reward=0.0)

    def step(self, rows: list[BatchRow]) -> PolicyUpdated:
        return self.trainer.train_step(self.batch(rows), self.bus.keys.trained_batches)

    def adapter(self, role: str) -> dict[str, torch.Tensor]:
        return self.trainer.backend.adapter_state(role)

    def optimizer_state(self, role: str) -> dict:
        return self.trainer.backend.optimizers[role].state_dict()

    def adapter_versions(self, role: str) -> list[str]:
        return sorted(path.name for path in self.settings.run_dir().joinpath("adapters", role).iterdir())


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def recording_gradients(trainer: Trainer) -> list[tuple[str, dict[str, torch.Tensor | None]]]:
    """Each optimizer step's role and the gradient of every adapter's parameters as it stepped (None: no
    gradient reached the parameter)."""
    backend, steps = trainer.backend, []
    step = backend.step

    def recorded() -> float:
        grads = {f"{role}:{name}": None if p.grad is None else p.grad.clone()
                 for role, parameters in backend.adapters.parameters.items()
                 for name, p in parameters.items()}
        steps.append((backend.adapters.active, grads))
        return step()

    backend.step = recorded
    return steps


def test_a_role_s_adapter_learns_from_its_own_tokens_only(tmp_path, tiny_model, bus):
    planner = [row("r0", "planner", 0), row("r1", None, 1, advantage=-1.0)]  # None: the default role
    solver = [row("r2", "solver", 2), row("r3", "solver", 3, advantage=-1.0)]
    other_tokens = [row("r2", "solver", 12), row("r3", "solver", 13, advantage=-1.0)]
    unsampled = [dataclasses.replace(r, loss_mask=[0] * len(r.tokens)) for r in solver]
    runs = {}
    for name, solver_rows in (("solver", solver), ("other tokens", other_tokens), ("unsampled", unsampled)):
        settings = lora_settings(tmp_path / name.replace(" ", "-"), tiny_model, bus.keys.run_id)
        run = Run(settings, bus)
        gradients = recording_gradients(run.trainer)
        update = run.step(planner + solver_rows)
        runs[name] = run, gradients, update

    def planner_step(name: str) -> dict:
        [(role, grads)] = [step for step in runs[name][1] if step[0] == "planner"]
        return grads

    reference = planner_step("solver")
    # no gradient of the planner's step reached the solver's adapter
    assert all(grad is None for name, grad in reference.items() if name.startswith("solver:"))
    for name in ("other tokens", "unsampled"):
        grads = planner_step(name)
        assert all(torch.equal(grads[key], reference[key]) for key in reference if key.startswith("planner:"))
        assert same_tensors(runs[name][0].adapter("planner"), runs["solver"][0].adapter("planner"))
    # the comparison can tell: the solver's own step did see its tokens
    solver_grads = {name: [g for role, g in runs[name][1] if role == "solver"] for name in runs}
    [with_tokens], [with_others] = solver_grads["solver"], solver_grads["other tokens"]
    assert any(not torch.equal(with_tokens[key], with_others[key])
               for key in with_tokens if key.startswith("solver:"))
    assert solver_grads["unsampled"] == []  # nothing sampled: no step of the solver at all
    assert runs["solver"][2].role_versions == {"planner": 1, "solver": 1}
    assert runs["unsampled"][2].role_versions == {"planner": 1, "solver": 0}
    assert {"train/planner/loss", "train/solver/loss", "train/loss"} <= runs["solver"][2].metrics.keys()


def test_a_role_s_step_leaves_every_other_adapter_and_its_optimizer_as_they_were(tmp_path, tiny_model, bus):
    run = Run(lora_settings(tmp_path, tiny_model, bus.keys.run_id), bus)
    first = run.step([row("r0", "planner", 0), row("r1", "solver", 1),
                      row("r2", "solver", 2, advantage=-1.0)])
    solver, solver_optimizer = run.adapter("solver"), run.optimizer_state("solver")
    planner = run.adapter("planner")
    assert solver_optimizer["state"], "the solver's Adam has momentum from its first step"
    second = run.step([row("r3", "planner", 3, version=1),
                       row("r4", "planner", 4, version=1, advantage=-1.0)])

    assert same_tensors(run.adapter("solver"), solver)
    assert all(same_tensors(run.optimizer_state("solver")["state"][index], state)
               for index, state in solver_optimizer["state"].items())
    assert not same_tensors(run.adapter("planner"), planner)
    assert (first.version, first.role_versions) == (1, {"planner": 1, "solver": 1})
    assert (second.version, second.role_versions) == (2, {"planner": 2, "solver": 1})
    # each published version of an adapter has a directory of its own; the solver's newest is still v1's
    assert run.adapter_versions("planner") == ["v00000", "v00001", "v00002"]
    assert run.adapter_versions("solver") == ["v00000", "v00001"]


def test_staleness_is_judged_by_the_version_of_the_row_s_own_role(tmp_path, tiny_model, bus):
    run = Run(lora_settings(tmp_path, tiny_model, bus.keys.run_id), bus)
    for version in range(2):  # the solver reaches version 2; the planner stays at 0
        run.step([row(f"s{version}", "solver", version, version=version)])
    update = run.step([row("p", "planner", 10, version=0), row("s", "solver", 11, version=0)])

    # both rows were sampled at version 0 of their role, the trainer is at version 2, eta is 1: the solver's
    # row is two versions of its role old, the planner's none
    assert update.dropped == {"stale": 1}
    assert update.trained_samples == 1
    assert update.role_versions == {"planner": 1, "solver": 2}
    assert update.metrics["samples/staleness_max"] == 0


def test_rows_of_a_frozen_role_or_of_no_role_of_the_run_are_left_out_with_their_reason(tmp_path, tiny_model,
                                                                                        bus, caplog):
    run = Run(lora_settings(tmp_path, tiny_model, bus.keys.run_id), bus)
    with caplog.at_level(logging.ERROR, logger="trainer"):
        update = run.step([row("r0", "planner", 0), row("r1", "judge", 1), row("r2", "critic", 2),
                           row("r3", "critic", 3)])

    assert update.dropped == {"frozen": 1, "unknown_role": 2}
    assert update.trained_samples == 1
    assert update.role_versions == {"planner": 1, "solver": 0}
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.role == "critic" and record.rows == 2
    assert "'critic'" in record.error and "planner, solver, judge" in record.error


def test_a_restarted_trainer_takes_up_every_adapter_its_optimizer_and_the_roles_versions(tmp_path, tiny_model,
                                                                                          bus):
    settings = lora_settings(tmp_path, tiny_model, bus.keys.run_id)
    run = Run(settings, bus)
    run.step([row("r0", "planner", 0), row("r1", "solver", 1)])
    last = run.step([row("r2", "planner", 2, version=1), row("r3", "planner", 3, version=1, advantage=-1.0)])
    checkpoint = Path(last.checkpoint_uri)
    assert not (checkpoint / "model.safetensors").exists(), "the base is not copied into a LoRA checkpoint"

    restarted = Run(settings, bus, start=last)
    assert restarted.trainer.role_versions == {"planner": 2, "solver": 1}
    for role in ("planner", "solver"):
        assert same_tensors(restarted.adapter(role), run.adapter(role))
        mine, theirs = restarted.optimizer_state(role)["state"], run.optimizer_state(role)["state"]
        assert mine.keys() == theirs.keys()
        assert all(same_tensors(mine[index], theirs[index]) for index in mine)
        for trainer in (run.trainer, restarted.trainer):
            trainer.backend.use_role(role)
        probe = row("probe", role, 99).tokens
        assert restarted.trainer.trainer_logprobs(probe) == run.trainer.trainer_logprobs(probe)
    rows = [row("r4", "planner", 4, version=2), row("r5", "solver", 5, version=1, advantage=-1.0)]
    batch = run.batch(rows)
    for trainer in (run.trainer, restarted.trainer):
        trainer.train(batch, rows)
    for role in ("planner", "solver"):
        assert same_tensors(restarted.adapter(role), run.adapter(role))


def test_the_roles_versions_a_trainer_starts_from():
    full = Settings(run_id="r", model={"path": "m"})
    lora = Settings(run_id="r", model={"path": "m"}, roles={"names": ROLES}, train={"lora_rank": 8})
    old = PolicyUpdated(version=7, checkpoint_uri="/nowhere/v7", batch_id="b7", servers=[],
                        parity_max_abs_diff=0.0, loss=0.0, trained_samples=1)  # recorded before roles existed
    new = old.model_copy(update={"role_versions": {"planner": 3, "solver": 5}})
    assert starting_role_versions(None, None, RunRoles.of(full)) == {"policy": 0}
    assert starting_role_versions(old, None, RunRoles.of(full)) == {"policy": 7}
    assert starting_role_versions(old, None, RunRoles.of(lora)) == {"planner": 7, "solver": 0}
    assert starting_role_versions(new, None, RunRoles.of(lora)) == {"planner": 3, "solver": 5}


def test_the_fleet_records_each_adapter_s_version_beside_the_trainer_s(bus):
    update = PolicyUpdated(version=4, checkpoint_uri="/c/v4", batch_id="b4", servers=["http://a:1", "http://b:2"],
                           parity_max_abs_diff=0.0, loss=0.0, trained_samples=1,
                           role_versions={"planner": 4, "solver": 2})
    publish_update(bus, update, bus.keys.trained_batches, adapters=("planner", "solver"))
    recorded = {key.decode(): int(value)
                for key, value in bus.redis.hgetall(FLEET_VERSIONS.key(bus.keys)).items()}
    assert recorded == {"http://a:1": 4, "planner@http://a:1": 4, "solver@http://a:1": 2,
                        "http://b:2": 4, "planner@http://b:2": 4, "solver@http://b:2": 2}


def test_a_full_fine_tune_publishes_its_one_role_at_the_trainer_s_version(tmp_path, tiny_model, bus):
    settings = Settings(run_id=bus.keys.run_id, storage_uri=str(tmp_path), model={"path": str(tiny_model)},
                        fleet={"urls": []}, train={"trackers": [], "learning_rate": 1e-4})
    run = Run(settings, bus)
    updates = [run.step([row("r0", None, 0)]), run.step([row("r1", "policy", 1, version=1)])]
    assert [(u.version, u.role_versions) for u in updates] == [(1, {"policy": 1}), (2, {"policy": 2})]
    assert (Path(updates[-1].checkpoint_uri) / "model.safetensors").exists()
    assert not settings.run_dir().joinpath("adapters").exists()


def test_a_lora_run_s_kl_reference_is_the_base_model_itself(tmp_path, tiny_model, bus):
    from rollstream.services.trainer.backends.base import load_model
    from rollstream.services.trainer.ppo import make_micro_batches, token_logprobs

    run = Run(lora_settings(tmp_path, tiny_model, bus.keys.run_id, kl_coef=0.5), bus)
    first = run.step([row("r0", "planner", 0), row("r1", "planner", 1, advantage=-1.0)])
    second = run.step([row("r2", "planner", 2, version=1),
                       row("r3", "planner", 3, version=1, advantage=-1.0)])

    assert run.trainer.reference is None, "no second model is loaded: the base is the model without adapters"
    assert abs(first.metrics["train/kl"]) < 1e-9  # an adapter starts as the base (its B is zero)
    assert second.metrics["train/kl"] > 0
    [micro] = make_micro_batches([row("r4", "planner", 4)], "token", 4096, 0)
    run.trainer.backend.use_role("planner")
    with torch.no_grad():
        base = token_logprobs(load_model(tiny_model, torch.device("cpu")), micro)
        assert torch.allclose(run.trainer.reference_logprobs(micro), base, atol=1e-6)
        assert not torch.allclose(token_logprobs(run.trainer.backend.model, micro), base, atol=1e-4)


def test_a_run_whose_default_role_is_frozen_trains_its_other_roles(tmp_path, tiny_model, bus):
    """The default role (the first listed) frozen, as a control that keeps one role at its start: the others
    train, each on its own probe, and the frozen role's rows are left out."""
    settings = Settings(run_id=bus.keys.run_id, storage_uri=str(tmp_path), model={"path": str(tiny_model)},
                        fleet={"urls": []}, roles={"names": {"judge": {"trained": False}, "solver": {}}},
                        train={"lora_rank": 8, "trackers": [], "learning_rate": 1e-3})
    run = Run(settings, bus)
    update = run.step([row("r0", None, 0), row("r1", "solver", 1)])
    assert (update.trained_samples, update.dropped, update.role_versions) == (1, {"frozen": 1}, {"solver": 1})
