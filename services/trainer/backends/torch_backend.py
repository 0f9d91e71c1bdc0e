"""The plain PyTorch trainer backend, on the CPU or one GPU: Adam, gradient clipping to
train.grad_clip, the optimizer state saved with torch.save beside the model and the RNG state.

TorchBackend trains the whole model (a full fine-tune); TorchLoraBackend trains one LoRA adapter per role
over the frozen base (train.lora_rank > 0, services/trainer/backends/lora.py), each adapter with an Adam of
its own.

Tests: tests/unit/services/trainer/test_trainer_backends.py (the DeepSpeed backend's steps are compared
with this one's), tests/unit/services/trainer/test_lora_backends.py (the adapters).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from rollstream.services.trainer.backends.base import (
    RNG_FILE,
    load_model,
    restore_rng_state,
    rng_state,
    state_dict_weights,
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
from rollstream.shared.inference.serving_weights import write_serving_checkpoint
from rollstream.shared.runtime.config import TrainSettings

OPTIMIZER_FILE = "optimizer.pt"


class TorchBackend:
    def __init__(self, settings: TrainSettings, model_path: Path) -> None:
        self.settings = settings
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_model(model_path, self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=settings.learning_rate)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def save(self, directory: Path) -> None:
        write_serving_checkpoint(self.model, directory)
        torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)
        torch.save(rng_state(), directory / RNG_FILE)

    def load_training_state(self, directory: Path) -> None:
        if (directory / OPTIMIZER_FILE).exists():
            self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, map_location=self.device))
        if (directory / RNG_FILE).exists():
            restore_rng_state(torch.load(directory / RNG_FILE, weights_only=False))

    def serving_weights(self):
        return state_dict_weights(self.model)


class TorchLoraBackend(RoleSwitching):
    """One LoRA adapter per role over the frozen base model, each with an Adam of its own. A checkpoint holds
    adapters/<role>/ (the adapter in peft's format and optimizer.pt) per role and the RNG state; not the base,
    which is model.path."""

    def __init__(self, settings: TrainSettings, model_path: Path, roles: tuple[str, ...]) -> None:
        self.settings = settings
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = with_adapters(load_model(model_path, self.device), settings, roles)
        self.adapters = RoleAdapters(model, roles)
        self.model = self.adapters.model
        self.optimizers = {role: torch.optim.Adam(parameters.values(), lr=settings.learning_rate)
                           for role, parameters in self.adapters.parameters.items()}
        self.use_role(roles[0])

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        role = self.adapters.active
        parameters = self.adapters.parameters[role].values()
        norm = torch.nn.utils.clip_grad_norm_(parameters, self.settings.grad_clip)
        self.optimizers[role].step()
        self.optimizers[role].zero_grad(set_to_none=True)
        return float(norm)

    @contextlib.contextmanager
    def base_model(self) -> Iterator[torch.nn.Module]:
        """The model with every adapter disabled: the base, the reference of a KL term."""
        with self.model.disable_adapter():
            yield self.model

    def adapter_state(self, role: str) -> dict[str, torch.Tensor]:
        return self.adapters.state(role)

    def save(self, directory: Path) -> None:
        for role in self.roles:
            write_adapter(self.model, role, self.adapters.state(role), directory / ADAPTERS_DIR / role)
            torch.save(self.optimizers[role].state_dict(), directory / ADAPTERS_DIR / role / OPTIMIZER_FILE)
        torch.save(rng_state(), directory / RNG_FILE)

    def load_training_state(self, directory: Path) -> None:
        for role in self.roles:
            saved = saved_adapter(directory, role)
            if saved is None:
                continue
            self.adapters.load(role, read_adapter(saved, self.settings))
            if (saved / OPTIMIZER_FILE).exists():
                self.optimizers[role].load_state_dict(torch.load(saved / OPTIMIZER_FILE,
                                                                 map_location=self.device))
        if (directory / RNG_FILE).exists():
            restore_rng_state(torch.load(directory / RNG_FILE, weights_only=False))
