"""The DeepSpeed backend of a LoRA run (train.lora_rank > 0): one peft adapter per role over the frozen base
model (services/trainer/backends/lora.py), and one DeepSpeed engine per adapter, over that adapter's
parameters alone, with an Adam of its own: a role's step (its gradient reduction, clipping and update) never
touches another role's adapter or optimizer state. The engines share the one model: the active role's
(use_role) runs the forwards and backwards.

Every rank walks the roles in the same order (each engine's backward and step reduce over the ranks). Under
ZeRO-3 the base's weights are partitioned over the ranks; an adapter's tensors are gathered (with every rank)
to be written or read.

A checkpoint holds, per role, adapters/<role>/ with the adapter in peft's format and the role's engine
checkpoint (its optimizer partitions; the frozen base left out of it) under `deepspeed/`, and the RNG
state.

Tests: tests/unit/services/trainer/test_lora_backends.py, which runs
tests/unit/services/trainer/deepspeed_step.py in a process of its own and compares its steps with the torch
backend's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from rollstream.services.trainer.backends.base import RNG_FILE, load_model, restore_rng_state, rng_state
from rollstream.services.trainer.backends.deepspeed_backend import (
    ENGINE_DIR,
    ENGINE_TAG,
    deepspeed_config,
    ensure_distributed,
    rank_device,
)
from rollstream.services.trainer.backends.lora import (
    ADAPTERS_DIR,
    RoleAdapters,
    RoleSwitching,
    read_adapter,
    saved_adapter,
    with_adapters,
    write_adapter,
)
from rollstream.shared.runtime.config import TrainSettings

log = logging.getLogger("trainer")


class RoleEngines(torch.nn.Module):
    """What the trainer calls `model`: forwards go through the active role's engine (which arms its gradient
    hooks for the next backward); every other attribute is the peft model's."""

    def __init__(self, engines: dict, adapters: RoleAdapters) -> None:
        super().__init__()
        self.engines = torch.nn.ModuleDict(engines)
        self.adapters = adapters

    def forward(self, *args, **kwargs):
        return self.engines[self.adapters.active](*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["adapters"].model, name)


class DeepSpeedLoraBackend(RoleSwitching):
    def __init__(self, settings: TrainSettings, model_path: Path, roles: tuple[str, ...]) -> None:
        import deepspeed
        import torch.distributed as dist

        ensure_distributed()
        self.settings = settings
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = rank_device()
        module = with_adapters(load_model(Path(model_path), torch.device("cpu")), settings, roles)
        self.adapters = RoleAdapters(module, roles)
        engines = {}
        for role in roles:
            # an engine takes the parameters that take gradients when it is made: this role's alone
            self.adapters.use(role)
            parameters = list(self.adapters.parameters[role].values())
            optimizer = torch.optim.Adam(parameters, lr=settings.learning_rate)
            config = deepspeed_config(settings, module.config.hidden_size, sum(p.numel() for p in parameters))
            engines[role], _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        self.engines = engines
        self.model = RoleEngines(engines, self.adapters)
        self.use_role(roles[0])

    def backward(self, loss: torch.Tensor) -> None:
        # as DeepSpeedBackend.backward: ZeRO's mean over the ranks turned back into the sum
        if self.world_size > 1:
            loss = loss * self.world_size
        self.engines[self.adapters.active].backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        engine = self.engines[self.adapters.active]
        engine.step()
        norm = engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    @contextlib.contextmanager
    def base_model(self) -> Iterator[torch.nn.Module]:
        """The model with every adapter disabled (forwards still through the active role's engine)."""
        with self.adapters.model.disable_adapter():
            yield self.model

    def gathered(self, role: str, modify: bool = False) -> contextlib.AbstractContextManager:
        """Under ZeRO-3: the role's adapter whole on every rank while in the context (with modify, rank 0's
        values partitioned again at its end); with every rank. Nothing to do under ZeRO-2."""
        if self.settings.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.adapters.parameters[role].values()),
                                                 modifier_rank=0 if modify else None)

    def adapter_state(self, role: str) -> dict[str, torch.Tensor] | None:
        with self.gathered(role):
            return self.adapters.state(role) if self.rank == 0 else None

    def save(self, directory: Path) -> None:
        import torch.distributed as dist

        active = self.adapters.active
        for role in self.roles:  # in the same order on every rank: each engine's save is a collective
            saved = Path(directory) / ADAPTERS_DIR / role
            state = self.adapter_state(role)
            if state is not None:
                write_adapter(self.adapters.model, role, state, saved)
            self.use_role(role)  # its parameters alone take gradients: the others are left out as frozen
            self.engines[role].save_checkpoint(str(saved / ENGINE_DIR), tag=ENGINE_TAG,
                                               exclude_frozen_parameters=True)
        if self.rank == 0:
            torch.save(rng_state(), Path(directory) / RNG_FILE)
        self.use_role(active)
        dist.barrier()

    def load_training_state(self, directory: Path) -> None:
        active = self.adapters.active
        for role in self.roles:
            saved = saved_adapter(directory, role)
            if saved is None:
                continue
            self.use_role(role)
            with self.gathered(role, modify=True):
                self.adapters.load(role, read_adapter(saved, self.settings))
            self.load_engine(role, saved / ENGINE_DIR)
        if (Path(directory) / RNG_FILE).exists():
            restore_rng_state(torch.load(Path(directory) / RNG_FILE, weights_only=False))
        self.use_role(active)

    def load_engine(self, role: str, engine_dir: Path) -> None:
        """The role's optimizer state from its engine checkpoint; without one, the optimizer starts fresh from
        the adapter just loaded."""
        engine = self.engines[role]
        if not engine_dir.exists():
            log.warning("no DeepSpeed optimizer state for this role; its optimizer starts fresh",
                        extra={"role": role, "directory": str(engine_dir)})
            engine.optimizer.refresh_fp32_params()  # ZeRO's own copy of the weights, which its steps update
            return
        path, _ = engine.load_checkpoint(str(engine_dir), tag=ENGINE_TAG, load_optimizer_states=True,
                                         load_lr_scheduler_states=False, load_module_strict=False)
        if path is None:
            raise RuntimeError(f"{engine_dir}: DeepSpeed found no checkpoint tagged {ENGINE_TAG!r}")
