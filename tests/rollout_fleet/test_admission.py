"""The replica's admissions (replica.py ``_run``): it claims a slot for every free one in one
buffer call (``admit_up_to``), and the slots its puts claim meanwhile are kept as well. No
model: a scripted engine answers at once; the buffer is the real MemoryBuffer, answering the
batched claim late, as the buffer actor or Redis does, so puts settle while it is out.

- every slot is used or given back: after stop nothing is in flight and
  ``started == consumed + queued`` (a credit lost in the interleaving stays in flight forever,
  and the bound then admits fewer groups each step until the learner starves);
- a free slot is claimed for each free in-flight place, in one call per refill, and with
  several replicas at most their share per call: two replicas waiting for the same version
  both sample from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from streamrl.buffer.memory import MemoryBuffer
from streamrl.config import RolloutConfig
from streamrl.rollout_fleet.replica import Replica
from tests.support.rollout import (
    IdTokenizer,
    ListedRewards,
    ScriptedEngine,
    scripted_prompts,
    train_steps,
)

REWARDS = [[0.0, 1.0]] * 8


class LateAdmissions(MemoryBuffer):
    """The memory buffer, with ``aadmit_up_to`` answering ``delay_s`` late."""

    def __init__(self, groups_per_step: int, max_staleness: int, delay_s: float) -> None:
        super().__init__(groups_per_step, max_staleness)
        self.delay_s = delay_s
        self.claims: list[int] = []

    def aadmit_up_to(self, n: int, holder: str = "") -> Awaitable[int]:
        async def late() -> int:
            await asyncio.sleep(self.delay_s)
            claimed = self.admit_up_to(n, holder)
            self.claims.append(claimed)
            return claimed
        return late()


def _replica(buffer: LateAdmissions, max_inflight: int) -> Replica:
    return Replica(ScriptedEngine(), buffer, scripted_prompts(REWARDS), ListedRewards(),
                   IdTokenizer(), RolloutConfig(n=2, max_new_tokens=8,
                                                max_inflight_groups=max_inflight),
                   admit_backoff_s=0.001)


def test_slots_claimed_by_puts_during_a_batched_claim_are_kept():
    buffer = LateAdmissions(groups_per_step=4, max_staleness=1, delay_s=0.02)
    train_steps(buffer, _replica(buffer, max_inflight=8), steps=12)
    s = buffer.stats()
    assert s.consumed == 12 * 4
    assert s.in_flight == 0 and s.started == s.consumed + s.queued, s


def test_free_slots_are_claimed_in_one_call():
    buffer = LateAdmissions(groups_per_step=4, max_staleness=1, delay_s=0.0)
    train_steps(buffer, _replica(buffer, max_inflight=8), steps=3)
    # The first call claims the whole bound, (0 + eta + 1) * B = 8: one per free place.
    assert buffer.claims[0] == 8, buffer.claims
    s = buffer.stats()
    assert s.in_flight == 0 and s.started == s.consumed + s.queued, s


def test_replicas_waiting_together_split_a_version():
    buffer = LateAdmissions(groups_per_step=8, max_staleness=0, delay_s=0.0)
    cfg = RolloutConfig(n=2, max_new_tokens=8, max_inflight_groups=8, num_replicas=2)
    engines = [ScriptedEngine(), ScriptedEngine()]
    replicas = [Replica(engine, buffer, scripted_prompts(REWARDS), ListedRewards(),
                        IdTokenizer(), cfg, admit_backoff_s=0.001) for engine in engines]

    async def one_version() -> None:
        for replica in replicas:
            replica.start()
        try:
            batch = await asyncio.to_thread(buffer.take, 8, 0, 10)
            buffer.ack([g.group_id for g in batch])
        finally:
            for replica in replicas:
                await replica.stop()

    asyncio.run(one_version())
    assert buffer.claims[:2] == [4, 4], buffer.claims  # ceil(8 / 2) each
    assert [len(engine.answered) for engine in engines] == [4, 4]
