"""streamrl.rollout_fleet."""
