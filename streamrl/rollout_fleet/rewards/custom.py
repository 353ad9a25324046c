"""verl-style custom reward functions: ``custom_reward_function.path`` / ``.name``.

The file is imported by path (in the reward worker process, never in the replica; the driver
imports it once up front so that a file that does not load fails before any engine starts)
and must define ``name`` with verl's signature::

    def compute_score(data_source: str, solution_str: str, ground_truth: str | None,
                      extra_info: dict) -> float | dict:
        ...

A dict return must hold ``"score"``; its other numeric keys are reported as metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from streamrl.errors import ConfigError
from streamrl.plugins import import_file

CustomFn = Callable[[str, str, "str | None", dict[str, Any]], Any]


def load_custom_function(path: str, name: str) -> CustomFn:
    module = import_file(path, f"reward.custom_path={path!r}")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"reward.custom_name={name!r}: {path} defines no such function")
    return fn
