"""A free TCP port for a server that binds it later (Serve's proxies, Redis, a TP group).

The usual trick, bind port 0 and close, returns a port from the kernel's ephemeral range,
the range every ``connect`` and every other ``bind(0)`` draws from. Between the pick and the
server's own bind, a Ray start opens dozens of such sockets, and once one of them took the
port: Serve's gRPC proxy failed to bind it and the service never came up. So the port is
drawn from below that range (and above Ray's worker ports, 10002-19999), where nothing is
handed out on its own, and checked free on the host and on the IPv6 wildcard (Serve's gRPC
proxy binds ``[::]``). A process never gets the same port twice.
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

_LOW = 20000  # above Ray's default worker ports (10002-19999)
_given: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int, host: str) -> bool:
    addrs = [(socket.AF_INET6 if ":" in host else socket.AF_INET, host)]
    if socket.has_ipv6 and host != "::":
        addrs.append((socket.AF_INET6, "::"))
    for family, addr in addrs:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, port))
        except OSError as e:
            no_ipv6 = e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL)
            if not (addr == "::" and no_ipv6):  # without IPv6 the host's bind decides
                return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` (and on ``[::]``) that no later ``bind(0)`` or outgoing
    connection will take; falls back to the kernel's pick where no such range is left."""
    high = _ephemeral_low() - 1
    if high - _LOW >= 1000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randint(_LOW, high)
            if port not in _given and _bindable(port, host):
                _given.add(port)
                return port
    while True:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _given:
            _given.add(port)
            return port
