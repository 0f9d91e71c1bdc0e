"""This host on the network (rollstream.shared.runtime.network)."""

from __future__ import annotations

import ipaddress
import socket

from rollstream.shared.runtime.network import free_port, host_address


def test_a_free_port_can_be_listened_on_where_it_was_found_free():
    for host in ("127.0.0.1", ""):
        port = free_port(host)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, port))
            sock.listen()


def test_the_host_address_is_an_ipv4_address():
    assert ipaddress.ip_address(host_address()).version == 4
