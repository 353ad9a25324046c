"""streamrl: asynchronous, off-policy, streaming RL post-training for LLMs."""

import os

# Ray token authentication stays on (DESIGN.md §9). Ray reads the mode once, when it is first
# imported, so it is set here: every streamrl module that imports ray is imported after this.
os.environ.setdefault("RAY_AUTH_MODE", "token")

__version__ = "0.1.0"
