"""Code a user names in the config: `module:name` or `path/to/file.py:name` (rewards, environments).

One loader for every such spec, so they read and fail the same way: `load_named(spec, field)` returns the
callable, or raises `UserCodeError` whose message names the field, the spec and what is wrong with it.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
from typing import Any


class UserCodeError(ValueError):
    """A spec that does not name a callable; the message names the field, the spec and why."""


def load_named(spec: str, field: str, forms: str = "`module:name` or `path.py:name`") -> Any:
    """The callable that `spec` (`module:name` or `path.py:name`) names."""
    location, sep, attr = spec.rpartition(":")
    if not sep or not location or not attr:
        raise UserCodeError(f"{field} {spec!r} is not of the form {forms}")
    module = _load_file(location, spec, field) if location.endswith(".py") else _load_module(location, spec, field)
    obj = getattr(module, attr, None)
    if obj is None or not callable(obj):
        raise UserCodeError(f"{field} {spec!r}: {location} has no callable named {attr!r}")
    return obj


def _load_file(path: str, spec: str, field: str):
    file = pathlib.Path(path).expanduser().resolve()
    if not file.is_file():
        raise UserCodeError(f"{field} {spec!r}: file {file} does not exist")
    name = f"streamrl_user_{file.stem}_{abs(hash(str(file)))}"
    if name in sys.modules:  # loaded once per process, whichever field names it
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise UserCodeError(f"{field} {spec!r}: importing {file} failed: {type(e).__name__}: {e}") from e
    return module


def _load_module(name: str, spec: str, field: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise UserCodeError(f"{field} {spec!r}: cannot import module {name!r} ({e})") from e
