"""User code loaded by path or name: custom reward files, agent environments and tools.

``import_file(path, what)`` imports a ``.py`` file once per process (the module is registered
before it runs, as ``import`` does, so dataclasses in it work; a file that fails to import is
unregistered again); ``import_module(name, what)`` imports by dotted name. ``what`` names the
config key and value: code that does not import (no such file or module, a syntax error, an
exception while it runs) is one ``ConfigError`` naming ``what``, the error and its line.
``AGENT_ENVS`` names the built-in agent environments ``rollout.agent`` takes besides
``module:Class``, and ``agent_env_spec(name)`` gives the ``module:Class`` a name stands for.
Depends only on ``streamrl.errors``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType

from streamrl.errors import ConfigError

AGENT_ENVS: dict[str, str] = {
    "relay": "streamrl.rollout_fleet.agent.envs.relay:RelayEnv",
    "calculator": "streamrl.rollout_fleet.agent.envs.calculator:CalculatorEnv",
    "reasoning_gym": "streamrl.rollout_fleet.agent.envs.rgym:ReasoningGymEnv",
}
"""Built-in agent environments by name (rollout_fleet/agent/envs/ describes them). Import paths,
not classes, so that config validation checks a name without importing the rollout fleet."""


def agent_env_spec(name: str) -> str:
    """The ``module:Class`` that ``rollout.agent=name`` loads: a built-in's, or ``name`` itself."""
    return AGENT_ENVS.get(name, name)


def import_file(path: str | Path, what: str) -> ModuleType:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ConfigError(f"{what}: no such file {file}")
    name = "streamrl_plugin_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{what}: cannot be imported as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        if isinstance(exc, Exception):  # the user's code, not ours: say where it broke
            raise ConfigError(f"{what}: {file} does not import: {_describe(exc)}") from exc
        raise
    return module


def import_module(name: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as exc:  # the user's code, not ours: say where it broke
        raise ConfigError(f"{what}: module {name} does not import: {_describe(exc)}") from exc


def _describe(exc: Exception) -> str:
    """``Type: message (file:line)``, the line being the imported module's own line that
    failed (not a line deep inside whatever it imported)."""
    if isinstance(exc, SyntaxError):
        text, file, line = exc.msg, exc.filename, exc.lineno
    else:
        ours = (__file__, str(Path(importlib.__file__).parent))  # our frames and importlib's
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if not f.filename.startswith(ours) and not f.filename.startswith("<frozen")]
        text = str(exc)
        file, line = (frames[0].filename, frames[0].lineno) if frames else (None, None)
    at = f" ({Path(file).name}:{line})" if file and line else ""
    return f"{type(exc).__name__}: {text}{at}"
