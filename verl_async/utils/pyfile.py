"""A user's Python file (a reward function, a dataset class) imported by its path, once per process.

Both `custom_reward_function.path` and `data.custom_cls.path` may name the same file (verl's
ReTool script names recipe/retool/retool.py for both): it is executed once and both see the
same module.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from types import ModuleType


def import_file(path: str) -> ModuleType:
    """The module of the .py file at `path` (an absolute path), executed on first use and kept in sys.modules."""
    mod_name = "verl_async_user_file_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # before executing it: a dataclass or pickle in the file looks itself up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    return module
