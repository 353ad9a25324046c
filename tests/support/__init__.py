"""Test support shared by every test folder: import it as ``tests.support...``.

- ``fixtures``: the shared fixtures (offline tiny model, a real redis-server, a local Ray),
  registered as a pytest plugin by the root ``conftest.py``.
- ``learner``: a small learner config, random batches, and a launcher for spawned FSDP ranks.
- ``weights``: weight-bus state dicts, digests, and spawned receiver / engine processes.
- Group/Trajectory factories live in ``streamrl.testing`` (benchmarks use them too).

Markers (declared in ``pyproject.toml``; the root conftest applies the skips): ``gpu`` skips
without CUDA, ``redis`` skips without ``redis-server``, ``vllm`` skips without vLLM, ``slow``
marks end-to-end runs (``-m "not slow"`` for a quick pass).
"""

from streamrl.net import free_port

__all__ = ["free_port"]
