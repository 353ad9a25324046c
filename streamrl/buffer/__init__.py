"""streamrl.buffer."""
