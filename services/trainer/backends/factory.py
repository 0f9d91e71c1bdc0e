"""make_backend: the trainer backend train.backend names ("torch" or "deepspeed"), loaded from a model
or training state directory; with train.lora_rank > 0, its LoRA variant: the base model at model_path with one
adapter per role (a checkpoint's adapters are restored by load_training_state).

Both backend modules are cheap to import: deepspeed itself is imported only when a DeepSpeedBackend
is made.

Tests: tests/unit/services/trainer/test_trainer_backends.py, test_lora_backends.py; the trainer goes through
it in tests/integration/test_trainer_restart.py.
"""

from __future__ import annotations

from pathlib import Path

from rollstream.services.trainer.backends.base import Backend, LoraBackend
from rollstream.services.trainer.backends.deepspeed_backend import DeepSpeedBackend
from rollstream.services.trainer.backends.deepspeed_lora import DeepSpeedLoraBackend
from rollstream.services.trainer.backends.torch_backend import TorchBackend, TorchLoraBackend
from rollstream.shared.runtime.config import TrainSettings


def make_backend(settings: TrainSettings, model_path: Path,
                 roles: tuple[str, ...] = ()) -> Backend | LoraBackend:
    """The backend of a full fine-tune, or with train.lora_rank > 0 one adapter per role of `roles` over the
    base model at model_path."""
    if settings.lora:
        if settings.backend == "deepspeed":
            return DeepSpeedLoraBackend(settings, model_path, roles)
        return TorchLoraBackend(settings, model_path, roles)
    if settings.backend == "deepspeed":
        return DeepSpeedBackend(settings, model_path)
    return TorchBackend(settings, model_path)
