"""streamrl.learner."""
