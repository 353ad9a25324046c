"""Multi-node placement for real, on an emulated three-node Ray cluster: a learner world that
spans two nodes trains with a replica on a third node that hosts no learner, and every
rendezvous binds on its own node's Ray IP, none on loopback."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from streamrl.config import load_config
from streamrl.controller import Controller
from tests.support.cluster import emulated_cluster, node_of

pytestmark = pytest.mark.slow


def test_learner_world_spans_two_nodes(tmp_path: Path, tiny_model_dir: Path) -> None:
    import ray

    from streamrl.runtime import build_runtime

    with emulated_cluster({"num_cpus": 1, "labels": {"pool": "train"}},
                          {"num_cpus": 1, "labels": {"pool": "train"}},
                          {"num_cpus": 1, "labels": {"pool": "rollout"}}) as cluster:
        cfg = load_config([
            f"model.path={tiny_model_dir}", "rollout=hf", "learner.world_size=2",
            "trainer.mode=sync", "trainer.total_steps=2", "task.train_batch_size=4",
            "actor.ppo_mini_batch_size=4", "trainer.logger=[jsonl]",
            f"trainer.output_dir={tmp_path}", f"runtime.address={cluster.address}",
            "runtime.train_pool.labels={pool:train}", "runtime.train_pool.strategy=STRICT_SPREAD",
            "runtime.rollout_pool.labels={pool:rollout}"])
        with build_runtime(cfg) as runtime:
            result = Controller(cfg, runtime).fit()
            assert runtime.learner is not None
            ranks = runtime.learner.actors
            learner_nodes = [node_of(rank) for rank in ranks]
            [replica_node] = [node_of(r) for r in runtime.fleet.replicas]
            bound = ray.get([rank.bound_addresses.remote() for rank in ranks], timeout=60)
    assert result.steps == 2
    assert len(set(learner_nodes)) == 2 and replica_node not in learner_nodes
    assert sorted(bound[0]) == ["learner.gloo", "learner.rendezvous", "node",
                                "weight_bus.control", "weight_bus.store"]
    assert sorted(bound[1]) == ["learner.gloo", "node"]  # joins rank 0's rendezvous
    for rank in bound:
        node_ip = rank.pop("node")
        for what, address in rank.items():
            host = address.removeprefix("tcp://").rsplit(":", 1)[0]
            assert host == node_ip and not ipaddress.ip_address(host).is_loopback, (what, address)
