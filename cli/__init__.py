"""The `rollstream` command (main.py) and what only the command line needs: the local run (local_run.py,
embedded_redis.py), inspect/, replay/, the tiny model and its warm-up (model/), the vLLM launcher
(vllm_server.py). Installed as rollstream.cli.
"""
