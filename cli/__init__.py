"""The `rollstream` command (main.py) and what only the command line needs: the local run (local_run.py and
run_servers.py, embedded_redis.py, child_processes.py), where vLLM CPU servers run (cpu_cores.py,
vllm_server.py), inspect/, replay/, the tiny model and its warm-up (model/). Installed as rollstream.cli.

Every process of the command line, and every process it starts, waits for OpenMP work passively: torch's
OpenMP threads sleep at a barrier instead of spinning. On a machine whose cores are shared (the local run's
vLLM servers, the trainer and the services; a busy neighbour), a spinning thread burns the core that the
thread it waits for needs: 50 warm-up steps of the tiny model took 57-71 s with two spinning threads beside
one busy core, 18 s with two passive ones, 16 s with one. Set before torch is imported (OpenMP reads it
once, as it loads); a value the user set wins.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
