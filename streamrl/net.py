"""Network helpers shared by every rendezvous (learner ranks, weight bus, engines, tests).

- ``LOOPBACK``: where a single-node run's rendezvous bind (every peer is on this machine),
- ``node_host(cluster_address)``: the address a rendezvous hosted by this process binds and
  advertises: loopback on a single-node run, else this node's IP as Ray knows it,
- ``free_port(host)``: a port free on ``host``, probed by the process that will bind it,
- ``is_loopback``, ``address_towards``, ``interface_of``: where a socket binds to be reached.
"""

from __future__ import annotations

import ipaddress
import socket

LOOPBACK = "127.0.0.1"


def node_host(cluster_address: str | None) -> str:
    """``runtime.address`` unset: a local Ray on one machine, so loopback keeps every port
    private. Set: peers may live on other nodes and reach this one at the IP Ray registered
    for it (call from the process that binds: the actor's node, not the driver's)."""
    if cluster_address is None:
        return LOOPBACK
    import ray  # lazily: weight_bus imports this module inside vLLM workers

    return str(ray.util.get_node_ip_address())


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` now (the caller binds it soon after)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP or a name) resolves to a loopback address."""
    return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback


def address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP connect sends nothing): where a
    process binds the sockets a peer at ``host`` must reach."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, 9))
        return str(sock.getsockname()[0])


def interface_of(ip: str) -> str | None:
    """The network interface that carries ``ip`` (Linux), for ``GLOO_SOCKET_IFNAME``: gloo
    otherwise binds where the hostname resolves, which /etc/hosts often maps to loopback."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), siocgifaddr,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None
