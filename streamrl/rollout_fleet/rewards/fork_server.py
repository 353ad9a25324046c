"""Preloaded by the reward pool's fork server, and imported nowhere else: warm dispatch code
for the workers it forks, and the fork server's own death with the replica that started it
(``dispatch.die_with_parent``; workers call it as their executor's initializer)."""

from __future__ import annotations

from streamrl.rollout_fleet.rewards.dispatch import die_with_parent

die_with_parent()
