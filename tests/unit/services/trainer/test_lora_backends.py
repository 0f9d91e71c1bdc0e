"""The LoRA backends (train.lora_rank > 0: one adapter per role over the frozen base, an optimizer each): the
DeepSpeed one (an engine per adapter, ZeRO-2 and ZeRO-3) takes the torch one's steps, resumes exactly from its
checkpoint, and on two ranks takes the one-process steps; the adapters they write are peft's, which peft
loads back onto the base to the trainer's logprobs.

The steps (deepspeed_step.LORA_STEPS): the planner's adapter on batch 0, the solver's on batch 1, the
planner's again on batch 1. DeepSpeed runs go to processes of their own (deepspeed_step.py, as in
test_trainer_backends.py); the torch backend's run here, through the same code.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.unit.services.trainer.test_trainer_backends import run_deepspeed, steps


def adapters_of(checkpoint) -> dict[str, dict[str, torch.Tensor]]:
    return {role: load_file(checkpoint / "adapters" / role / "adapter_model.safetensors")
            for role in steps.LORA_ROLES}


STEP_TOLERANCE = 1e-5
"""Between two runs' adapters: a hundredth of what one step moves an element (Adam at learning rate 1e-3),
above the rounding that summing the gradient in another order leaves (about 1e-6)."""


def largest_difference(first, second) -> float:
    a, b = adapters_of(first), adapters_of(second)
    assert {role: a[role].keys() for role in a} == {role: b[role].keys() for role in b}
    return max((a[role][name] - b[role][name]).abs().max().item() for role in a for name in a[role])


@pytest.fixture(scope="module")
def torch_lora_run(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("torch-lora")
    saves = [root / "step1", root / "step2"]
    spec = {"task": "lora", "backend": "torch", "model": str(tiny_model),
            "saves": [str(path) for path in saves]}
    return steps.lora_main(spec), saves


@pytest.fixture(scope="module")
def deepspeed_lora_run(tiny_model, tmp_path_factory):
    runs = {}

    def run(stage: int):
        if stage not in runs:
            root = tmp_path_factory.mktemp(f"lora-zero{stage}")
            saves = [root / "step1", root / "step2"]
            [result] = run_deepspeed({"task": "lora", "zero_stage": stage, "model": str(tiny_model),
                                      "saves": [str(path) for path in saves]}, root)
            runs[stage] = result, saves
        return runs[stage]

    return run


def test_the_torch_lora_steps_train_each_role_on_its_own(torch_lora_run):
    result, (after_solver, after_planner) = torch_lora_run
    for step in ("step0", "step1", "step2"):
        # the comparisons below are worth something: every step moves its role's loss
        assert abs(result[step]["loss_after"] - result[step]["loss_before"]) > 1e-3
    # the planner's step moved its adapter alone: the solver's, whose Adam has momentum from the step
    # before, stayed as it was
    before, after = adapters_of(after_solver), adapters_of(after_planner)
    assert all(torch.equal(before["solver"][name], after["solver"][name]) for name in before["solver"])
    assert any(not torch.equal(before["planner"][name], after["planner"][name]) for name in before["planner"])
    assert result["probe_planner"] != result["probe_solver"]


def test_a_written_adapter_is_peft_s_and_serves_the_trainer_s_logprobs(torch_lora_run, tiny_model):
    from peft import PeftModel

    from rollstream.services.trainer.backends.base import load_model
    from rollstream.services.trainer.ppo import sequence_logprobs

    result, (_, checkpoint) = torch_lora_run
    for role in steps.LORA_ROLES:
        model = PeftModel.from_pretrained(load_model(tiny_model, torch.device("cpu")),
                                          str(checkpoint / "adapters" / role))
        assert sequence_logprobs(model, steps.PROBE) == pytest.approx(result[f"probe_{role}"], abs=1e-6)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_lora_step_is_the_torch_step(stage, deepspeed_lora_run, torch_lora_run):
    ds, ds_saves = deepspeed_lora_run(stage)
    ref, ref_saves = torch_lora_run
    for step in ("step0", "step1", "step2"):
        mine, theirs = ds[step], ref[step]
        assert mine["micro_batches"] == theirs["micro_batches"] == 3
        assert mine["loss_before"] == pytest.approx(theirs["loss_before"], abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert mine["loss_after"] == pytest.approx(theirs["loss_after"], abs=1e-5)
    for role in steps.LORA_ROLES:
        assert ds[f"probe_{role}"] == pytest.approx(ref[f"probe_{role}"], abs=1e-5)
    for mine, theirs in zip(ds_saves, ref_saves):
        assert largest_difference(mine, theirs) < STEP_TOLERANCE


@pytest.mark.parametrize("stage", [2, 3])
def test_a_resumed_deepspeed_lora_backend_steps_like_an_uninterrupted_one(stage, deepspeed_lora_run, tmp_path,
                                                                          tiny_model):
    ds, (after_solver, after_planner) = deepspeed_lora_run(stage)
    resumed = tmp_path / "resumed"
    [result] = run_deepspeed({"task": "lora_resume", "zero_stage": stage, "model": str(tiny_model),
                              "checkpoint": str(after_solver), "save": str(resumed)}, tmp_path)
    for key in ("loss_before", "grad_norm", "loss_after"):
        assert result["step2"][key] == pytest.approx(ds["step2"][key], abs=1e-7, rel=1e-6), key
    assert largest_difference(resumed, after_planner) < 1e-7


def test_a_resumed_torch_lora_backend_steps_like_an_uninterrupted_one(torch_lora_run, tiny_model, tmp_path):
    ref, (after_solver, after_planner) = torch_lora_run
    spec = {"task": "lora_resume", "backend": "torch", "model": str(tiny_model),
            "checkpoint": str(after_solver), "save": str(tmp_path / "resumed")}
    result = steps.lora_main(spec)
    for key in ("loss_before", "grad_norm", "loss_after"):
        assert result["step2"][key] == ref["step2"][key], key
    assert result["probe_planner"] == ref["probe_planner"]
    assert largest_difference(tmp_path / "resumed", after_planner) == 0.0


@pytest.mark.parametrize("stage", [2, 3])
def test_two_deepspeed_lora_ranks_take_the_one_process_steps(stage, tiny_model, tmp_path):
    env = {} if torch.cuda.device_count() >= 2 else {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    reference = steps.lora_main({"task": "lora_ranks", "backend": "torch", "model": str(tiny_model),
                                 "save": str(tmp_path / "torch")})
    results = run_deepspeed({"task": "lora_ranks", "zero_stage": stage, "model": str(tiny_model),
                             "save": str(tmp_path / "ranks")}, tmp_path, world_size=2, env=env)
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]
    for step in ("step0", "step1", "step2"):
        assert reference[step]["micro_batches"] == 4
        assert sum(r[step]["loss_before"] for r in results) == pytest.approx(reference[step]["loss_before"],
                                                                              abs=1e-6)
        for result in results:
            assert result[step]["grad_norm"] == pytest.approx(reference[step]["grad_norm"], rel=1e-5)
    assert largest_difference(tmp_path / "ranks", tmp_path / "torch") < STEP_TOLERANCE
