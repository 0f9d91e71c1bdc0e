"""The DeepSpeed backend (ZeRO-2 and ZeRO-3, on the CPU, or on a CUDA GPU where there is one) takes the
torch backend's steps: same loss, same gradient norm, same update, a saved model transformers loads, and an
exact resume from its saved state.

DeepSpeed sets up process-global state (torch.distributed), so its runs go to processes of their own
(tests/unit/services/trainer/deepspeed_step.py, which writes JSON); the torch backend runs here, through the
same step code.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollstream.services.trainer.backends.base import load_model
from rollstream.services.trainer.backends.torch_backend import TorchBackend
from tests.support import REPO, free_port, skip_does_not_apply

HELPER = Path(__file__).with_name("deepspeed_step.py")
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Generous: the first DeepSpeed run on a machine compiles DeepSpeed's shared-memory comm op.
RUN_TIMEOUT_S = 900


def _load_helper():
    spec = importlib.util.spec_from_file_location("deepspeed_step", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


steps = _load_helper()


def run_deepspeed(spec: dict, workdir: Path, world_size: int = 1,
                  env: dict[str, str] | None = None) -> list[dict]:
    """Run the helper in `world_size` processes (ranks of one gloo group); their results, by rank."""
    base = {key: value for key, value in os.environ.items() if key not in DIST_ENV} | (env or {})
    spec = {**spec, "result": str(workdir / "result-{rank}.json")}
    port = free_port()
    processes, logs = [], []
    try:
        for rank in range(world_size):
            env = dict(base)
            if world_size > 1:
                env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            log = workdir / f"rank{rank}.log"
            logs.append(log)
            with log.open("w") as out:
                processes.append(subprocess.Popen([sys.executable, str(HELPER), json.dumps(spec)], cwd=REPO,
                                                  env=env, stdout=out, stderr=subprocess.STDOUT))
        codes = [process.wait(timeout=RUN_TIMEOUT_S) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    if any(codes):
        tails = "\n".join(f"--- rank {rank} (exit {code}):\n{log.read_text()[-4000:]}"
                          for rank, (code, log) in enumerate(zip(codes, logs)))
        pytest.fail(f"DeepSpeed {spec['task']} run failed\n{tails}")
    return [json.loads((workdir / f"result-{rank}.json").read_text()) for rank in range(world_size)]


def max_difference(first: Path, second: Path) -> float:
    """Largest weight difference between two saved models, each loaded by transformers."""
    a = load_model(first, torch.device("cpu")).state_dict()
    b = load_model(second, torch.device("cpu")).state_dict()
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.fixture(scope="module")
def torch_run(tiny_model, tmp_path_factory):
    """The torch backend's two steps (batch 0, then batch 1), saved after each."""
    root = tmp_path_factory.mktemp("torch")
    saves = [root / "step0", root / "step1"]
    cfg = steps.settings("torch")
    return steps.train(TorchBackend(cfg, tiny_model), cfg, [str(path) for path in saves]), saves


@pytest.fixture(scope="module")
def deepspeed_run(tiny_model, tmp_path_factory):
    """The DeepSpeed backend's same two steps, once per ZeRO stage."""
    runs = {}

    def run(stage: int):
        if stage not in runs:
            root = tmp_path_factory.mktemp(f"zero{stage}")
            saves = [root / "step0", root / "step1"]
            [result] = run_deepspeed({"task": "train", "zero_stage": stage, "model": str(tiny_model),
                                      "saves": [str(path) for path in saves]}, root)
            runs[stage] = result, saves
        return runs[stage]

    return run


@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_step_is_the_torch_step(stage, deepspeed_run, torch_run):
    ds, ds_saves = deepspeed_run(stage)
    ref, ref_saves = torch_run
    # ZeRO-3 really partitions the parameters (a rank holds none whole); ZeRO-2 keeps them whole.
    assert any(ds["partitioned"]) == (stage == 3)
    assert ds["pad_token_id"] == ref["pad_token_id"]
    for step in ("step0", "step1"):
        mine, theirs = ds[step], ref[step]
        assert mine["micro_batches"] == theirs["micro_batches"] == 3
        # The comparison is worth something: clipping takes part and the update moves the loss.
        assert theirs["grad_norm"] > steps.settings("torch").grad_clip
        assert abs(theirs["loss_after"] - theirs["loss_before"]) > 1e-2
        assert mine["loss_before"] == pytest.approx(theirs["loss_before"], abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert mine["loss_after"] == pytest.approx(theirs["loss_after"], abs=1e-5)
    assert ds["probe_logprobs"] == pytest.approx(ref["probe_logprobs"], abs=1e-5)
    for mine, theirs in zip(ds_saves, ref_saves):
        assert max_difference(mine, theirs) < 1e-6


@pytest.mark.parametrize("stage", [2, 3])
def test_a_resumed_backend_steps_like_an_uninterrupted_one(stage, deepspeed_run, tmp_path):
    ds, (first, second) = deepspeed_run(stage)
    resumed, fresh = tmp_path / "resumed", tmp_path / "fresh"
    [result] = run_deepspeed({"task": "resume", "zero_stage": stage, "checkpoint": str(first),
                              "resumed": str(resumed), "fresh_optimizer": str(fresh)}, tmp_path)
    assert result["resumed"]["loss_before"] == pytest.approx(ds["step1"]["loss_before"], abs=1e-7)
    assert result["resumed"]["grad_norm"] == pytest.approx(ds["step1"]["grad_norm"], rel=1e-6)
    assert result["resumed"]["loss_after"] == pytest.approx(ds["step1"]["loss_after"], abs=1e-7)
    assert max_difference(resumed, second) < 1e-7
    # Without the saved optimizer state the same step lands elsewhere, so the comparison can tell.
    assert max_difference(fresh, second) > 1e-6


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_sharing_the_micro_batches_take_the_one_process_step(stage, tiny_model, tmp_path):
    # Two NCCL ranks cannot share a GPU: with fewer than two, the ranks and the reference run on the CPU.
    env = {} if torch.cuda.device_count() >= 2 else {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    [reference] = run_deepspeed({"task": "torch_ranks", "model": str(tiny_model),
                                 "save": str(tmp_path / "torch")}, tmp_path, env=env)
    results = run_deepspeed({"task": "ranks", "zero_stage": stage, "model": str(tiny_model),
                             "save": str(tmp_path / "ranks")}, tmp_path, world_size=2, env=env)
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]
    assert reference["micro_batches"] == 4
    assert sum(r["loss_before"] for r in results) == pytest.approx(reference["loss_before"], abs=1e-6)
    for result in results:
        assert result["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert sum(r["loss_after"] for r in results) == pytest.approx(reference["loss_after"], abs=1e-5)
    assert max_difference(tmp_path / "ranks", tmp_path / "torch") < 1e-6


def test_on_a_gpu_the_torch_backend_takes_the_cpus_steps(request, tiny_model, tmp_path):
    """Where a CUDA GPU is present the torch backend trains on it (torch_run): the same losses, gradient norms
    and saved weights as the same steps on the CPU, in a process that sees no GPU."""
    if not torch.cuda.is_available():
        skip_does_not_apply("no CUDA GPU on this machine: the torch backend trains on the CPU, as elsewhere")
    on_gpu, gpu_saves = request.getfixturevalue("torch_run")
    saves = [tmp_path / "step0", tmp_path / "step1"]
    spec = {"task": "torch", "model": str(tiny_model), "saves": [str(path) for path in saves]}
    [on_cpu] = run_deepspeed(spec, tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert on_cpu["device"] == "cpu"
    for step in ("step0", "step1"):
        for key in ("loss_before", "grad_norm", "loss_after"):
            assert on_gpu[step][key] == pytest.approx(on_cpu[step][key], abs=1e-5), (step, key)
    assert max_difference(gpu_saves[1], saves[1]) < 1e-5


START_ON_THE_CPU = """
from rollstream.services.trainer.backends.deepspeed_backend import (ensure_distributed, leave_distributed,
                                                                    shared_memory_op_builder)

if shared_memory_op_builder() is None:
    raise SystemExit("DeepSpeed builds no shared-memory op here")
ensure_distributed()
leave_distributed()
"""


def test_a_build_lock_left_by_a_killed_start_does_not_stall_the_next_one(tmp_path):
    """A trainer killed while DeepSpeed's shared-memory op was built or checked at its start (torch's
    extension builder, at every start) left the builder's lock file behind, and every later start waited on
    it for ever. The next start removes it and comes up."""
    from torch.utils.cpp_extension import _get_build_directory

    name = "deepspeed_shm_comm"
    extensions = tmp_path / "extensions"
    # the op as `make setup` built it, so that the start only checks it (copied with the times ninja reads)
    shutil.copytree(_get_build_directory(name, verbose=False), extensions / name)
    (extensions / name / "lock").touch()
    env = {key: value for key, value in os.environ.items() if key not in DIST_ENV}
    env.update(TORCH_EXTENSIONS_DIR=str(extensions), CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    start = subprocess.run([sys.executable, "-c", START_ON_THE_CPU], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
    if "builds no shared-memory op here" in start.stderr:
        skip_does_not_apply("DeepSpeed builds no shared-memory op here")
    assert start.returncode == 0, start.stderr[-4000:]
    assert not (extensions / name / "lock").exists()
    assert (extensions / name / f"{name}.so").exists()
