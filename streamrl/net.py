"""Network helpers shared by every rendezvous (learner ranks, weight bus, engines, tests)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the caller binds it soon after)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
