"""streamrl.data."""
