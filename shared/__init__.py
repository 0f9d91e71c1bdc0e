"""rollstream's library: what the services import, and the only thing they share besides the streams.

    errors.py     every error under one base, RollstreamError
    contract/     the contract between services: events, the stream bus, the archive, batch files
    runtime/      what every service runs on: configuration, the service runtime, storage, tracking
    inference/    the vLLM fleet client and serving checkpoints
    sandbox/      running untrusted code: the backend protocol, one module per backend, the git workspace
    tasks/        prompt rows, datasets, Harbor tasks, SWE-bench rows, answer scoring
    grading/      grading an agent's diff: applying it, running the tests, reading their verdict
    agent/        agent loops, tools, tool-call formats, built-in environments

No module here imports a service or the command line (tests/unit/test_layout.py).
"""
