"""Trainer backends: where the model lives and how a gradient step is taken. The loss is the same
for every backend (services/trainer/ppo.py); a backend only accumulates gradients, steps, and saves.

    torch      plain PyTorch on the CPU or one GPU
    deepspeed  DeepSpeed ZeRO stage 2 or 3 (services/trainer/deepspeed_backend.py)

A training state directory holds everything needed to continue exactly where the trainer stopped:
the model weights (HF safetensors, loadable by vLLM and transformers), the optimizer state and the
random-number state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from rollstream.shared.inference.serving_weights import write_serving_checkpoint
from rollstream.shared.runtime.config import TrainSettings

OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"


class Backend(Protocol):
    model: torch.nn.Module
    """The module to run forward passes through."""
    device: torch.device

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of `loss` (not rescaled: the loss carries its own weights)."""

    def step(self) -> float:
        """Clip the accumulated gradient to train.grad_clip, take an optimizer step, clear the
        gradient. Returns the gradient norm before clipping."""

    def save(self, directory: Path) -> None:
        """Write the model (HF safetensors the fleet can reload, tied heads included: see
        shared/inference/serving_weights.py), the optimizer state and the RNG state to `directory`."""

    def load_training_state(self, directory: Path) -> None:
        """Restore the optimizer and RNG state saved by `save` (the model was loaded from it already)."""


def load_model(path: Path, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


def make_backend(settings: TrainSettings, model_path: Path) -> Backend:
    if settings.backend == "deepspeed":
        from rollstream.services.trainer.deepspeed_backend import DeepSpeedBackend

        return DeepSpeedBackend(settings, model_path)
    return TorchBackend(settings, model_path)


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


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
