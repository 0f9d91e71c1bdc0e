"""What every trainer backend is and shares: the Backend protocol, model loading and the RNG state.

The loss is the same for every backend (services/trainer/ppo.py); a backend only accumulates
gradients, steps, and saves. The backends (torch_backend.py, deepspeed_backend.py) import this
module and nothing imports them back, except factory.py.

A training state directory holds everything needed to continue exactly where the trainer stopped:
the model weights (HF safetensors, loadable by vLLM and transformers), the optimizer state and the
random-number state. A LoRA backend (LoraBackend, train.lora_rank > 0) trains one adapter per role over the
frozen base instead: its directory holds each adapter (peft's format) with its optimizer state, and the
random-number state (services/trainer/backends/lora.py).

Tests: tests/unit/services/trainer/test_trainer_backends.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch

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

    def serving_weights(self) -> Callable[[], Iterable[tuple[str, torch.Tensor]]] | None:
        """The model's tensors as a checkpoint names them (a tied head under its own name too), for a
        collective weight sync: on the leading rank a fresh pass each call, None on the others. Called on
        every rank: a backend whose ranks hold parts of the model gathers them here."""


class LoraBackend(Protocol):
    """A backend of one LoRA adapter per role over a frozen base model, each adapter with an optimizer of its
    own. Its `model` runs forwards through the active role's adapter (use_role), `backward` and `step` train
    that role's adapter alone."""

    model: torch.nn.Module
    device: torch.device
    roles: tuple[str, ...]
    """The roles, each with an adapter of its own, in the order every rank walks them."""

    def use_role(self, role: str) -> None:
        """Make the role's adapter the one forwards run through and gradients reach (every other adapter's
        parameters take none); step() steps its optimizer."""

    def base_model(self) -> AbstractContextManager[torch.nn.Module]:
        """The model with its adapters disabled (the base: the reference of a KL term), while in the
        context."""

    def adapter_state(self, role: str) -> dict[str, torch.Tensor] | None:
        """The role's adapter tensors on the CPU (peft's names) on the leading rank, None on the others;
        called on every rank (a backend whose ranks hold parts of the model gathers them)."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> float:
        """Clip the active role's gradient to train.grad_clip, step its optimizer, clear its gradient;
        returns the gradient norm before clipping."""

    def save(self, directory: Path) -> None:
        """Write every role's adapter (peft's format) and optimizer state, and the RNG state."""

    def load_training_state(self, directory: Path) -> None:
        """Restore what `save` wrote: every adapter, its optimizer state, the RNG state."""


def state_dict_weights(model: torch.nn.Module) -> Callable[[], Iterable[tuple[str, torch.Tensor]]]:
    """A model's state dict as serving weights: transformers' state_dict names a tied head under both names,
    as the serving checkpoint does (shared/inference/serving_weights.py)."""
    return lambda: model.state_dict().items()


def load_model(path: Path, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
