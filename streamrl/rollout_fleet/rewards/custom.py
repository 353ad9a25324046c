"""verl-style custom reward functions: ``custom_reward_function.path`` / ``.name``.

The file is imported by path (in the reward worker process, never in the replica) and must
define ``name`` with verl's signature::

    def compute_score(data_source: str, solution_str: str, ground_truth: str | None,
                      extra_info: dict) -> float | dict:
        ...

A dict return must hold ``"score"``; its other numeric keys are reported as metrics.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

CustomFn = Callable[[str, str, "str | None", dict[str, Any]], Any]


def load_custom_function(path: str, name: str) -> CustomFn:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"reward.custom_path={path!r}: no such file")
    module_name = "streamrl_custom_reward_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"reward.custom_path={path!r}: cannot be imported as a module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # registered first, as `import` does, for dataclasses
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"reward.custom_name={name!r}: {file} defines no such function")
    return fn
