"""Group builders shared by the buffer tests."""

from __future__ import annotations

import uuid

from streamrl.types import OBSERVATION_VERSION, Group, Trajectory


def make_group(
    versions: list[int] | int, group_id: str | None = None, n: int = 2, obs_tokens: int = 1
) -> Group:
    """A group whose policy tokens carry ``versions`` (plus observation tokens stamped -1)."""
    versions = [versions] if isinstance(versions, int) else list(versions)
    gid = group_id or uuid.uuid4().hex
    trajs = []
    for i in range(n):
        toks = versions + [OBSERVATION_VERSION] * obs_tokens
        trajs.append(Trajectory(
            uid=f"{gid}-{i}", group_id=gid, prompt_ids=[1, 2, 3],
            response_ids=list(range(4, 4 + len(toks))),
            loss_mask=[1] * len(versions) + [0] * obs_tokens,
            logprobs=[-0.5] * len(toks), versions=toks, reward=float(i),
        ))
    return Group(group_id=gid, trajectories=trajs)
