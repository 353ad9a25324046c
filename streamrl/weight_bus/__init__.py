"""streamrl.weight_bus."""
