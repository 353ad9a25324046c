"""User code loaded by path: custom reward files, agent environments and tools.

``import_file(path, what)`` imports a ``.py`` file once per process (the module is registered
before it runs, as ``import`` does, so dataclasses in it work; a file that fails to import is
unregistered again). ``what`` names the config key and value for error messages.
Depends on nothing in streamrl.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_file(path: str | Path, what: str) -> ModuleType:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"{what}: no such file {file}")
    name = "streamrl_plugin_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"{what}: cannot be imported as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
