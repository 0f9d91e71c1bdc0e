"""The plain PyTorch trainer backend, on the CPU or one GPU: Adam, gradient clipping to
train.grad_clip, the optimizer state saved with torch.save beside the model and the RNG state.

Tests: tests/unit/services/trainer/test_trainer_backends.py (the DeepSpeed backend's steps are compared
with this one's).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollstream.services.trainer.backends.base import (
    RNG_FILE,
    load_model,
    restore_rng_state,
    rng_state,
    state_dict_weights,
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
