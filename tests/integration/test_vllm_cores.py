"""A real vLLM server started through rollstream runs on the core it leased (cli/cpu_cores.py): vLLM says so
in its log (`core ids=[c]`), its worker may run there only, and the server's own process holds the lease
(the kernel ends it with the server). Read off the shared pair (tests/integration/conftest.py), so that this
test starts no server of its own.
"""

from __future__ import annotations

import os

from rollstream.cli.vllm_server import cpu_build
from tests.support import held_core_leases, revive, skip_does_not_apply, vllm_workers


def test_each_server_runs_on_the_core_it_leased(vllm_pair):
    if not cpu_build():
        skip_does_not_apply("vLLM's GPU build binds no OpenMP threads")
    for server in revive(vllm_pair):
        assert server.cores is not None and len(server.cores) == 1
        (core,) = server.cores
        assert f"core ids=[{core}]" in server.log_path.read_text()
        assert [os.sched_getaffinity(worker) for worker in vllm_workers(server.pid)] == [{core}]
        assert held_core_leases(server.pid) == [core]
