"""streamrl.rollout_fleet.rewards."""
