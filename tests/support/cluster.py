"""An emulated multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``).

Each node is a real raylet with its own CPUs and labels; they share this machine's IP, which
Ray picks as it would on a real node (not loopback). Tests point ``runtime.address`` at it
and steer pools with ``runtime.<pool>.labels``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import streamrl  # noqa: F401 - sets RAY_AUTH_MODE before ray is imported


@contextmanager
def emulated_cluster(*nodes: dict[str, Any]) -> Iterator[Any]:
    """Start one node per ``add_node`` kwargs (the first is the head); yields the Cluster.
    Shut down with the cluster's own ``shutdown`` (never ``ray stop``)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=nodes[0])
    try:
        for node in nodes[1:]:
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        ip = cluster.head_node.node_ip_address
        assert not ipaddress.ip_address(ip).is_loopback, (
            f"Ray picked loopback ({ip}) as the node IP: this machine has no other address")
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def node_of(actor: Any) -> str:
    """The id of the Ray node ``actor`` runs on (every emulated node shares one IP)."""
    import ray

    return str(ray.get(actor.__ray_call__.remote(
        lambda _self: ray.get_runtime_context().get_node_id()), timeout=60))
