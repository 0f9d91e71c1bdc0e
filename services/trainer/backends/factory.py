"""make_backend: the trainer backend train.backend names ("torch" or "deepspeed"), loaded from a model
or training state directory.

Both backend modules are cheap to import: deepspeed itself is imported only when a DeepSpeedBackend
is made.

Tests: tests/unit/services/trainer/test_trainer_backends.py; the trainer goes through it in
tests/integration/test_trainer_restart.py.
"""

from __future__ import annotations

from pathlib import Path

from rollstream.services.trainer.backends.base import Backend
from rollstream.services.trainer.backends.deepspeed_backend import DeepSpeedBackend
from rollstream.services.trainer.backends.torch_backend import TorchBackend
from rollstream.shared.runtime.config import TrainSettings


def make_backend(settings: TrainSettings, model_path: Path) -> Backend:
    if settings.backend == "deepspeed":
        return DeepSpeedBackend(settings, model_path)
    return TorchBackend(settings, model_path)
