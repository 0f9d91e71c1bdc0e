"""The model's settings (`model.*`, RS_MODEL__*): the model a run starts from and how its vLLM servers serve
it; and the vLLM arguments rollstream sets itself, which no section's vllm_args may set.

    python -m pytest tests/unit/shared/runtime/test_config.py -q
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from rollstream.shared.runtime.sections import Section


class ModelSettings(Section):
    path: Path = Path("models/tiny-llama-warm")
    """HF model directory the run starts from; the default, the tiny model after a short supervised warm-up
    (`rollstream build-model`, `rollstream warmup`), is made by `rollstream run` when missing."""
    served_name: str = "tiny"
    """Model name the vLLM servers serve it under."""
    max_model_len: int = Field(1024, ge=16)
    """The served context length, as vLLM's --max-model-len (the local run starts vLLM with it). A server
    reports its own on /v1/models, and that is what a turn is held to: a longer one is used, a shorter one
    is an error at start."""
    vllm_args: list[str] = []
    """Further command-line arguments of every vLLM server rollstream starts (the local run, `rollstream
    serve-policy`, Compose's CPU server), as vLLM spells them: ["--max-num-seqs", "64"]. A compilation
    argument (-O, -cc, --compilation-config) replaces the CPU build's --enforce-eager. What rollstream sets
    itself (the model, its name, host, port, context length, dtype) comes from its own settings instead."""

    @field_validator("vllm_args")
    @classmethod
    def _not_what_rollstream_sets(cls, args: list[str]) -> list[str]:
        return vllm_args_rollstream_does_not_set(args, "model")


def vllm_args_rollstream_does_not_set(args: list[str], section: str) -> list[str]:
    """`args`, unless one is a vLLM argument rollstream sets from its own settings (those of `section`)."""
    owned = {"--model": f"{section}.path", "--served-model-name": f"{section}.served_name",
             "--host": "listen_host", "--port": "the server's port",
             "--max-model-len": f"{section}.max_model_len",
             "--dtype": "float32, which the trainer's parity probe needs"}
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in owned:
            raise ValueError(f"{name} is set by rollstream ({owned[name]}), not in {section}.vllm_args")
    return args
