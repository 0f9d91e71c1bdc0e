"""Training steps through a trainer backend, taken the way the trainer takes them, on small synthetic
batches.

test_trainer_backends.py imports it for the torch backend and runs it as a script for the DeepSpeed
backend: DeepSpeed sets up process-global state (torch.distributed), so each DeepSpeed run gets
processes of its own.

    python tests/unit/services/trainer/deepspeed_step.py '{"task": TASK, ...}'
    (TASK: train, resume, ranks, torch or torch_ranks; lora, lora_resume or lora_ranks for the LoRA backends;
    see main() and lora_main())

writes its results as JSON to the path given as "result" ("{rank}" in it becomes the process's rank).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from rollstream.services.trainer.ppo import make_micro_batches, policy_loss, sequence_logprobs, token_logprobs
from rollstream.shared.contract.batches import BatchRow
from rollstream.shared.runtime.config import TrainSettings

# Three micro-batches per step, one of them with two rows and one row packing two samples.
MICRO_BATCH_TOKENS = 40
# Four micro-batches: two for each of two ranks.
RANKS_MICRO_BATCH_TOKENS = 29
PAD_ID = 0
VOCAB = 352
PROBE = [3, 17, 250, 9, 41, 120, 77, 5]


LORA_ROLES = ("planner", "solver")
LORA_STEPS = (("planner", 0), ("solver", 1), ("planner", 1))
"""A LoRA run's steps: (the role trained, the seed of its rows); the solver's step comes between the
planner's two, whose second must not see it."""


def lora_settings(backend: str, zero_stage: int = 2) -> TrainSettings:
    # an adapter starts as the base (its B is zero): a learning rate that moves it visibly in a step
    return TrainSettings(backend=backend, zero_stage=zero_stage, learning_rate=1e-3, grad_clip=1.0,
                         lora_rank=8, lora_alpha=16)


def settings(backend: str, zero_stage: int = 2) -> TrainSettings:
    # grad_clip below the batches' gradient norms (about 6), so clipping takes part in the comparison.
    # A learning rate small enough that no ratio leaves the clip range in the step: a clipped token's
    # loss no longer depends on the weights, and the loss after the step must tell updates apart.
    return TrainSettings(backend=backend, zero_stage=zero_stage, learning_rate=3e-5, grad_clip=1.0)


def synthetic_rows(seed: int) -> list[BatchRow]:
    """Segments of different lengths, the last tokens of each sampled; rollout r0 has two segments."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [("r0", 0, 29, 11), ("r0", 1, 20, 6), ("r1", 0, 13, 5), ("r2", 0, 8, 3), ("r3", 0, 6, 2)]
    advantages = [1.2, 1.2, -0.8, 0.5, -1.5]
    rows = []
    for index, ((rollout, segment, length, sampled), advantage) in enumerate(zip(shapes, advantages)):
        tokens = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        mask = [0] * (length - sampled) + [1] * sampled
        # Near the untrained model's own logprobs (about -log 352), so the importance weights stay sane.
        behaviour = (-5.9 + 0.6 * (torch.rand(length, generator=generator) - 0.5)).tolist()
        rows.append(BatchRow(sample_index=index, trajectory_id=f"t-{rollout}", rollout_id=rollout,
                             group_id="g0", session_id=f"s-{rollout}", segment_index=segment, tokens=tokens,
                             response_length=sampled, loss_mask=mask,
                             rollout_logprobs=[value if m else 0.0 for value, m in zip(behaviour, mask)],
                             turn_policy_versions=[0], status="completed", reward=advantage,
                             advantage=advantage))
    return rows


def batch_loss(backend, micros, cfg: TrainSettings, *, grad: bool) -> float:
    total = 0.0
    for micro in micros:
        with torch.set_grad_enabled(grad):
            loss, _ = policy_loss(token_logprobs(backend.model, micro), micro, clip_eps=cfg.clip_eps,
                                  decoupled=cfg.decoupled, importance_weight_cap=cfg.importance_weight_cap,
                                  kl_coef=cfg.kl_coef)
        if grad:
            backend.backward(loss)
        total += loss.item()
    return total


def train_step(backend, rows: list[BatchRow], cfg: TrainSettings, *,
               micro_batch_tokens: int = MICRO_BATCH_TOKENS, rank: int = 0,
               world_size: int = 1) -> dict[str, float]:
    """One optimizer step on `rows` as the trainer takes it; the loss before and after the step (the
    same proximal logprobs both times, so the two losses differ only by the update). With several
    ranks, each takes every world_size-th micro-batch and reports the losses of its own."""
    micros = make_micro_batches(rows, cfg.loss_aggregation, micro_batch_tokens, PAD_ID, backend.device)
    mine = micros[rank::world_size]
    with torch.no_grad():
        for micro in mine:
            micro.prox_logprobs = token_logprobs(backend.model, micro)
    started = time.perf_counter()
    before = batch_loss(backend, mine, cfg, grad=True)
    stepped = time.perf_counter()
    grad_norm = backend.step()
    done = time.perf_counter()
    after = batch_loss(backend, mine, cfg, grad=False)
    return {"loss_before": before, "grad_norm": grad_norm, "loss_after": after, "micro_batches": len(micros),
            "forward_backward_seconds": stepped - started, "step_seconds": done - stepped}


def train(backend, cfg: TrainSettings, saves: list[str]) -> dict:
    """A step on batch 0, save, a step on batch 1, save; the probe's logprobs after the first step."""
    out: dict = {"pad_token_id": backend.model.config.pad_token_id}
    for step, directory in enumerate(saves):
        out[f"step{step}"] = train_step(backend, synthetic_rows(step), cfg)
        if step == 0:
            out["probe_logprobs"] = sequence_logprobs(backend.model, PROBE)
        backend.save(Path(directory))
    return out


def lora_train(backend, cfg: TrainSettings, steps, saves: dict[int, str], *, rank: int = 0,
               world_size: int = 1, micro_batch_tokens: int = MICRO_BATCH_TOKENS) -> dict:
    """LORA_STEPS (from the index of the first of `steps`), each on its role's adapter; saved after the steps
    `saves` names; each role's probe logprobs at the end."""
    out: dict = {}
    for index, (role, seed) in steps:
        backend.use_role(role)
        out[f"step{index}"] = train_step(backend, synthetic_rows(seed), cfg, rank=rank, world_size=world_size,
                                         micro_batch_tokens=micro_batch_tokens)
        if index in saves:
            backend.save(Path(saves[index]))
    for role in LORA_ROLES:
        backend.use_role(role)
        out[f"probe_{role}"] = sequence_logprobs(backend.model, PROBE)
    return out


def lora_main(spec: dict) -> dict:
    """The LoRA tasks: lora (LORA_STEPS, saved after the second and the third), lora_resume (the third step
    from the second's save), lora_ranks (LORA_STEPS over the ranks' shares, saved at the end); on the torch
    backend where spec["backend"] says so."""
    from rollstream.services.trainer.backends.factory import make_backend

    cfg = lora_settings(spec.get("backend", "deepspeed"), spec.get("zero_stage", 2))
    torch.manual_seed(cfg.seed)  # as the trainer seeds it: the adapters' initial weights are drawn from it
    backend = make_backend(cfg, Path(spec["model"]), LORA_ROLES)
    steps = list(enumerate(LORA_STEPS))
    if spec["task"] == "lora":
        return lora_train(backend, cfg, steps, {1: spec["saves"][0], 2: spec["saves"][1]})
    if spec["task"] == "lora_resume":
        backend.load_training_state(Path(spec["checkpoint"]))
        return lora_train(backend, cfg, steps[2:], {2: spec["save"]})
    if spec["task"] == "lora_ranks":
        rank, world_size = getattr(backend, "rank", 0), getattr(backend, "world_size", 1)
        out = lora_train(backend, cfg, steps, {len(steps) - 1: spec["save"]}, rank=rank,
                         world_size=world_size, micro_batch_tokens=RANKS_MICRO_BATCH_TOKENS)
        return {"rank": rank, "world_size": world_size, **out}
    raise ValueError(f"unknown task {spec['task']!r}")


def main(spec: dict) -> dict:
    from rollstream.services.trainer.backends.deepspeed_backend import DeepSpeedBackend

    if spec["task"].startswith("lora"):
        return lora_main(spec)

    # The torch backend's steps in a process of their own (with CUDA_VISIBLE_DEVICES='': on the CPU).
    if spec["task"] in ("torch", "torch_ranks"):
        from rollstream.services.trainer.backends.torch_backend import TorchBackend

        cfg = settings("torch")
        backend = TorchBackend(cfg, Path(spec["model"]))
        if spec["task"] == "torch":
            return {"device": str(backend.device), **train(backend, cfg, spec["saves"])}
        # What the "ranks" task's two ranks take together, in one process.
        out = train_step(backend, synthetic_rows(0), cfg, micro_batch_tokens=RANKS_MICRO_BATCH_TOKENS)
        backend.save(Path(spec["save"]))
        return out
    cfg = settings("deepspeed", spec["zero_stage"])
    if spec["task"] == "train":
        backend = DeepSpeedBackend(cfg, Path(spec["model"]))
        out = {"partitioned": [p.numel() == 0 for p in backend.engine.module.parameters()]}
        out.update(train(backend, cfg, spec["saves"]))
        return out
    if spec["task"] == "resume":
        # From the first save, with its training state and, for contrast, without it (a fresh optimizer).
        out = {}
        for name, restore in (("resumed", True), ("fresh_optimizer", False)):
            backend = DeepSpeedBackend(cfg, Path(spec["checkpoint"]))
            if restore:
                backend.load_training_state(Path(spec["checkpoint"]))
            out[name] = train_step(backend, synthetic_rows(1), cfg)
            backend.save(Path(spec[name]))
        return out
    if spec["task"] == "ranks":
        backend = DeepSpeedBackend(cfg, Path(spec["model"]))
        out = {"rank": backend.rank, "world_size": backend.world_size}
        out.update(train_step(backend, synthetic_rows(0), cfg, micro_batch_tokens=RANKS_MICRO_BATCH_TOKENS,
                              rank=backend.rank, world_size=backend.world_size))
        backend.save(Path(spec["save"]))
        return out
    raise ValueError(f"unknown task {spec['task']!r}")


if __name__ == "__main__":
    from rollstream.services.trainer.backends.deepspeed_backend import leave_distributed

    spec = json.loads(sys.argv[1])
    try:
        result = main(spec)
    finally:
        leave_distributed()
    result_path = Path(spec["result"].replace("{rank}", os.environ.get("RANK", "0")))
    result_path.write_text(json.dumps(result, indent=2))
