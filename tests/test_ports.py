"""The one port picker every local server start uses (``specserve.ports``)."""

from __future__ import annotations

import socket

from specserve import ports
from specserve.ports import free_port


def test_ports_come_from_below_the_ephemeral_range_and_never_twice():
    """A Ray start opens dozens of sockets on ephemeral ports; none of them can take a port
    drawn below that range between the pick and the server's own bind."""
    got = [free_port() for _ in range(200)]
    assert len(set(got)) == len(got)
    assert all(ports._LOW <= p < ports._ephemeral_low() for p in got)
    for p in got[:20]:  # each is free where Serve binds it
        with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as s:
            s.bind(("::" if socket.has_ipv6 else "127.0.0.1", p))


def test_a_port_a_server_listens_on_is_not_bindable():
    """Serve's gRPC proxy binds ``[::]``; a port held there (or on the host) is taken."""
    family, wildcard = (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET,
                                                                         "0.0.0.0")
    with socket.socket(family) as held:
        held.bind((wildcard, 0))
        held.listen()
        assert not ports._bindable(held.getsockname()[1], "127.0.0.1")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        assert not ports._bindable(held.getsockname()[1], "127.0.0.1")
    assert ports._bindable(free_port(), "127.0.0.1")
