"""DeepSpeed ZeRO (stage 2 or 3) trainer backend: the same protocol as TorchBackend
(services/trainer/backends/base.py), so the trainer's loss code does not know which one it drives.

One process per device. Under the deepspeed launcher the distributed environment comes from it; without
one (the CPU, tests) this process is a world of one, on gloo.

Gradient accumulation belongs to the caller: backward() once per micro-batch with a loss that already
carries its weights, step() once. DeepSpeed is configured so it neither counts micro-batches nor divides
by them (`managed_gradient_accumulation: false`, one accumulation step): step() is the only boundary.

With several ranks (data parallel), gradients are summed over them: each rank backward()s its share of
the micro-batches with the minibatch-wide weights. ZeRO reduces gradients inside every backward, so
every rank must call backward() equally often per step; under ZeRO-3 every forward gathers parameters
from all ranks, so forwards too must be run by all ranks together.

A saved directory holds the full model as HF safetensors (gathered from the partitions under ZeRO-3),
DeepSpeed's own checkpoint of the partitioned optimizer state under `deepspeed/`, and the RNG state.

Tests: tests/unit/services/trainer/test_trainer_backends.py, which runs
tests/unit/services/trainer/deepspeed_step.py in processes of their own (on the CPU, gloo) and compares
their steps with the torch backend's.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

import torch

from rollstream.services.trainer.backends.base import (
    RNG_FILE,
    load_model,
    restore_rng_state,
    rng_state,
    state_dict_weights,
)
from rollstream.shared.inference.serving_weights import add_tensor_copy, tied_head_names
from rollstream.shared.runtime.config import TrainSettings
from rollstream.shared.runtime.network import free_port

log = logging.getLogger(__name__)

ENGINE_DIR = "deepspeed"
"""Subfolder of a training state directory with DeepSpeed's checkpoint (optimizer partitions)."""
ENGINE_TAG = "state"
"""One checkpoint per directory, so a fixed tag: load does not depend on DeepSpeed's `latest` file."""

_DEFAULT_BUCKET = int(5e8)


def ensure_distributed() -> None:
    """Join the launcher's process group, or make this process a world of one when there is none."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if dist.is_available() and dist.is_initialized():
        return
    # Defaults only: a launcher (deepspeed, torchrun) has set these already and they must win.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    on_cpu = get_accelerator().device_name() == "cpu"
    # gloo on the CPU whatever is installed: DeepSpeed would switch to oneCCL wherever its bindings happen
    # to be importable.
    backend = "gloo" if on_cpu else get_accelerator().communication_backend_name()
    load_shared_memory_op()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is not None and int(os.environ["WORLD_SIZE"]) > 1:
        # torchrun's store still holds the addresses the ranks of its last attempt published: a group started
        # again would read them and fail to connect to processes that are gone. Each attempt reads its own.
        store = dist.PrefixStore(f"rollstream/attempt-{attempt}", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False))
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def shared_memory_op_builder():
    """DeepSpeed's builder of its shared-memory comm op, where DeepSpeed would load the op (its accelerator
    has one and DeepSpeed's own check says it builds here); else None."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return builder


def load_shared_memory_op() -> None:
    """Load DeepSpeed's shared-memory comm op (the CPU's) before init_distributed does, under a lock that
    cannot outlive its holder; `make setup` calls it too, so that a first start does not spend a minute
    compiling the op.

    Its loader is torch's extension builder, which holds a lock *file* in the op's build directory while it
    compiles, or checks that the build is current, at every process's start. A process killed meanwhile (a
    trainer stopped as it came up) leaves the file behind, and every later start waits on it for ever. Here
    the load happens while holding an flock in that directory, which the kernel drops with its holder: a
    lock file found while holding it was left by a process that is gone, and is removed. init_distributed
    then finds the op loaded (DeepSpeed keeps what it loaded)."""
    from torch.utils.cpp_extension import _get_build_directory

    builder = shared_memory_op_builder()
    if builder is None:
        return
    build_directory = Path(_get_build_directory(builder.name, verbose=False))  # torch's own path for it
    with (build_directory / "rollstream.flock").open("w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = build_directory / "lock"
        if stale.exists():
            log.warning("removing %s, left by a process killed while it built or checked DeepSpeed's %s op",
                        stale, builder.name)
            stale.unlink()
        builder.load()


def leave_distributed() -> None:
    """Tear down this process's group before the interpreter exits. Left to the exit, gloo's threads can end
    a rank whose work is done with SIGABRT ("terminate called without an active exception"), which a
    launcher counts as a failed rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def rank_device() -> torch.device:
    """The device of this process's rank (its LOCAL_RANK's accelerator, made the current one), or the CPU."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    accelerator.set_device(local_rank)
    return torch.device(accelerator.device_name(local_rank))


def deepspeed_config(settings: TrainSettings, hidden_size: int, parameters: int) -> dict:
    """The DeepSpeed config: fp32, the caller's gradient accumulation, clipping to train.grad_clip."""
    bucket = max(1, min(_DEFAULT_BUCKET, hidden_size * hidden_size))
    zero: dict = {
        "stage": settings.zero_stage,
        "contiguous_gradients": True,
        "overlap_comm": False,
        "reduce_bucket_size": bucket,
    }
    if settings.zero_stage == 2:
        zero["allgather_bucket_size"] = max(bucket, min(_DEFAULT_BUCKET, parameters))
    else:
        # The sizes transformers' Trainer derives from the hidden size ("auto"). DeepSpeed's fixed default
        # persistence threshold (1e5 elements) would leave every weight of a small model unpartitioned.
        zero["stage3_prefetch_bucket_size"] = max(1, int(0.9 * hidden_size * hidden_size))
        zero["stage3_param_persistence_threshold"] = 10 * hidden_size
    return {
        # The batch-size keys only feed DeepSpeed's sample counters: the caller decides what a batch is.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # DeepSpeed's own (managed) accumulation would take every backward for a boundary at one step, and
        # ZeRO-2 then keeps only the last micro-batch's gradient; at N steps it divides the loss by N and
        # steps only on every Nth step() call. Unmanaged: backward() accumulates, step() is the boundary.
        "managed_gradient_accumulation": False,
        "gradient_clipping": settings.grad_clip,
        "zero_optimization": zero,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class EngineModel(torch.nn.Module):
    """What the trainer calls `model`: forward passes go through the DeepSpeed engine, which arms ZeRO's
    gradient hooks for the next backward; every other attribute (config, dtype, ...) is the HF model's.
    The engine itself will not do: its `config` is DeepSpeed's config dict, not the model's."""

    def __init__(self, engine) -> None:
        super().__init__()
        self.engine = engine

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            engine = self.__dict__["_modules"].get("engine")
            if engine is None:
                raise
            return getattr(engine.module, name)


class DeepSpeedBackend:
    """`model` runs forward passes through the engine (see EngineModel); `engine` is the DeepSpeed engine."""

    def __init__(self, settings: TrainSettings, model_path: Path) -> None:
        import deepspeed
        import torch.distributed as dist

        ensure_distributed()
        self.settings = settings
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = rank_device()

        module = load_model(Path(model_path), torch.device("cpu"))
        parameters = sum(p.numel() for p in module.parameters())
        # The same optimizer and hyper-parameters as TorchBackend, so both backends take the same step.
        optimizer = torch.optim.Adam(module.parameters(), lr=settings.learning_rate)
        self.config = deepspeed_config(settings, module.config.hidden_size, parameters)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=module, optimizer=optimizer,
                                                                 config=self.config)
        self.model = EngineModel(self.engine)

    def backward(self, loss: torch.Tensor) -> None:
        # ZeRO averages gradients over the data-parallel ranks; the loss weights already sum to one over
        # the whole (all ranks') batch, so the mean is turned back into the sum. No-op in a world of one.
        if self.world_size > 1:
            loss = loss * self.world_size
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def save(self, directory: Path) -> None:
        import torch.distributed as dist

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = self.full_state_dict()  # collective: every rank takes part
        if self.rank == 0:
            self.engine.module.save_pretrained(directory, state_dict=state, safe_serialization=True)
            tied = tied_head_names(self.engine.module)
            # the fleet's reload needs the head written out (shared/inference/serving_weights.py)
            if tied is not None:
                add_tensor_copy(directory, source=tied[0], target=tied[1])
            for path in directory.glob("*.safetensors"):
                # safetensors is written 0600; the servers loading it may run as another user
                path.chmod(0o644)
            torch.save(rng_state(), directory / RNG_FILE)
        self.engine.save_checkpoint(str(directory / ENGINE_DIR), tag=ENGINE_TAG)  # collective
        dist.barrier()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on the CPU on rank 0 (None on the other ranks)."""
        if self.settings.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            state = self.engine.module.state_dict() if self.rank == 0 else None
        if state is None:
            return None
        # ZeRO-2 parameters are views into one flat buffer: transformers 4 takes tensors sharing storage
        # for tied weights and will not save them. Copies of their own are safe with every version.
        return {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in state.items()}

    def serving_weights(self):
        if self.settings.zero_stage == 3:
            # every rank holds a part of each parameter: gathered here, with every rank taking part, one
            # module's parameters at a time onto rank 0's host memory (DeepSpeed's consolidated 16-bit state
            # dict), so the accelerators never hold the whole model
            state = self.full_state_dict()
            return None if state is None else (lambda: state.items())
        return state_dict_weights(self.engine.module) if self.rank == 0 else None

    def load_training_state(self, directory: Path) -> None:
        directory = Path(directory)
        engine_dir = directory / ENGINE_DIR
        if engine_dir.exists():
            path, _ = self.engine.load_checkpoint(str(engine_dir), tag=ENGINE_TAG, load_optimizer_states=True,
                                                  load_lr_scheduler_states=False)
            if path is None:
                raise RuntimeError(f"{engine_dir}: DeepSpeed found no checkpoint tagged {ENGINE_TAG!r}")
        else:
            log.warning("no DeepSpeed optimizer state; the optimizer starts fresh",
                        extra={"directory": str(directory)})
        if (directory / RNG_FILE).exists():
            restore_rng_state(torch.load(directory / RNG_FILE, weights_only=False))
