"""This host on the network, as the services and the launchers see it: the address its name resolves to, and a
TCP port free right now.

    python -m pytest tests/unit/shared/runtime/test_network.py -q
"""

from __future__ import annotations

import socket


def host_address() -> str:
    """The address this host's name resolves to: what other machines reach it at (a container's or pod's own
    address in Compose and Kubernetes); 127.0.0.1 when the name does not resolve."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now ("" for every interface); another process could still take it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
