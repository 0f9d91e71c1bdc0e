"""LoRA adapters over a frozen base model, one per trained role (train.lora_rank > 0): what the torch and
DeepSpeed backends of a LoRA run share.

The model is the base with one peft LoRA adapter per role (rank, alpha, dropout and target modules from
train.*), all of them initialised from the trainer's seed. RoleAdapters.use makes one role's adapter the
active one: the forwards run through it, and its parameters alone take gradients, so that a role's step
never moves another's adapter (each role has an optimizer of its own in the backends).

An adapter is written in peft's format, which vLLM loads (`--enable-lora`) and transformers reads back:
adapter_config.json and adapter_model.safetensors, the tensors named as peft names them (the adapter's name
left out). write_adapter writes one from the adapter's tensors, read_adapter reads one back and checks that
it is an adapter of this run's shape.

Tests: tests/unit/services/trainer/test_lora_backends.py.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch

from rollstream.shared.inference.adapter_sync import ADAPTER_WEIGHTS
from rollstream.shared.runtime.config import TrainSettings

log = logging.getLogger("trainer")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTERS_DIR = "adapters"
"""A LoRA checkpoint's folder of adapters: one folder per role, with the role's optimizer state."""


def lora_config(settings: TrainSettings):
    from peft import LoraConfig

    return LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha,
                      lora_dropout=settings.lora_dropout, target_modules=list(settings.lora_target_modules),
                      bias="none", task_type="CAUSAL_LM")


def with_adapters(model: torch.nn.Module, settings: TrainSettings, roles: tuple[str, ...]) -> torch.nn.Module:
    """`model` (its weights frozen) with one LoRA adapter per role, named after the role."""
    from peft import get_peft_model

    if not roles:
        raise ValueError("a LoRA trainer needs a trained role (roles.names) to train an adapter of")
    config = lora_config(settings)
    try:
        peft_model = get_peft_model(model, config, adapter_name=roles[0])
    except ValueError as exc:  # peft's: no module of the model matches the targets
        raise ValueError(f"train.lora_target_modules {settings.lora_target_modules}: {exc}") from exc
    for role in roles[1:]:
        peft_model.add_adapter(role, config)
    return peft_model


def lora_parameters(model: torch.nn.Module, role: str) -> dict[str, torch.nn.Parameter]:
    """The parameters of the role's adapter, by the name peft's adapter file gives each (the adapter's name,
    which follows a `lora_*` part of the parameter's name, left out)."""
    found = {}
    for name, parameter in model.named_parameters():
        parts = name.split(".")
        for index in range(len(parts) - 1):
            if parts[index].startswith("lora_") and parts[index + 1] == role:
                found[".".join(parts[:index + 1] + parts[index + 2:])] = parameter
                break
    return found


class RoleAdapters:
    """The adapters of a peft model, by role, and which of them is active."""

    def __init__(self, model: torch.nn.Module, roles: tuple[str, ...]) -> None:
        self.model = model
        self.roles = roles
        self.parameters = {role: lora_parameters(model, role) for role in roles}
        for role, parameters in self.parameters.items():
            if not parameters:
                raise ValueError(f"the model has no adapter parameters for role {role!r}")
        self.active: str | None = None

    def use(self, role: str) -> None:
        """Forwards run through the role's adapter, and only its parameters take gradients."""
        if role not in self.parameters:
            raise ValueError(f"no adapter for role {role!r}: this trainer trains {', '.join(self.roles)}")
        self.model.set_adapter(role)
        for name, parameters in self.parameters.items():
            for parameter in parameters.values():
                parameter.requires_grad_(name == role)
        self.active = role

    def state(self, role: str) -> dict[str, torch.Tensor]:
        """The role's adapter tensors, copied to the CPU, by their names in the adapter file."""
        return {name: parameter.detach().to("cpu", copy=True).contiguous()
                for name, parameter in self.parameters[role].items()}

    def load(self, role: str, state: dict[str, torch.Tensor]) -> None:
        """Set the role's adapter to `state` (read_adapter's)."""
        parameters = self.parameters[role]
        if state.keys() != parameters.keys():
            missing = sorted(parameters.keys() - state.keys())
            unexpected = sorted(state.keys() - parameters.keys())
            raise ValueError(f"the adapter of role {role!r} does not fit the model: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        with torch.no_grad():
            for name, parameter in parameters.items():
                parameter.copy_(state[name].to(parameter.device, parameter.dtype))


class RoleSwitching:
    """What both LoRA backends do the same with their RoleAdapters (`adapters`): name their roles, and make
    one the active one."""

    adapters: RoleAdapters

    @property
    def roles(self) -> tuple[str, ...]:
        return self.adapters.roles

    def use_role(self, role: str) -> None:
        self.adapters.use(role)


def saved_adapter(directory: Path, role: str) -> Path | None:
    """The role's folder in the checkpoint `directory`; None when the checkpoint has no adapter of the role
    (said in the log): the role starts from the base."""
    saved = Path(directory) / ADAPTERS_DIR / role
    if (saved / ADAPTER_WEIGHTS).exists():
        return saved
    log.warning("the checkpoint has no adapter of this role: it starts from the base",
                extra={"role": role, "directory": str(directory)})
    return None


def write_adapter(model: torch.nn.Module, role: str, state: dict[str, torch.Tensor], directory: Path) -> None:
    """Write the role's adapter in peft's format (adapter_config.json, adapter_model.safetensors) into
    `directory`, readable by the servers."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.peft_config[role])
    config.inference_mode = True  # as peft saves one: an adapter to serve
    config.save_pretrained(str(directory))
    save_file(state, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        (directory / name).chmod(0o644)  # safetensors are written 0600; vLLM may run as another user


def read_adapter(directory: Path, settings: TrainSettings) -> dict[str, torch.Tensor]:
    """The tensors of the adapter in `directory`; ValueError when it is not an adapter of train.lora_rank,
    lora_alpha and lora_target_modules (the run's settings changed since it was written)."""
    from safetensors.torch import load_file

    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    written = (config.get("r"), float(config.get("lora_alpha", 0)),
               sorted(config.get("target_modules") or []))
    wanted = (settings.lora_rank, float(settings.lora_alpha), sorted(settings.lora_target_modules))
    if written != wanted:
        raise ValueError(f"{directory}: an adapter of rank {written[0]}, alpha {written[1]:g} on "
                         f"{written[2]}; the run trains rank {wanted[0]}, alpha {wanted[1]:g} on {wanted[2]} "
                         "(train.lora_rank, lora_alpha, lora_target_modules)")
    return load_file(str(directory / ADAPTER_WEIGHTS))
