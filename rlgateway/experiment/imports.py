"""User code named in a spec: `package.module:name` (importable) or `path/to/file.py:name` (a
file, relative to the spec's folder). A name that cannot be resolved is a ValueError saying
which and why, before anything starts."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def import_target(ref: str, *, base_dir: Path | None = None, what: str = "target") -> Any:
    module_ref, sep, name = ref.rpartition(":")
    if not sep or not module_ref or not name:
        raise ValueError(f"{what} {ref!r} must be `package.module:name` or `file.py:name`")
    if module_ref.endswith(".py"):
        path = Path(module_ref)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise ValueError(f"{what} {ref!r}: no file {path}")
        module = load_file(path)
    else:
        try:
            module = importlib.import_module(module_ref)
        except ImportError as exc:
            raise ValueError(f"{what} {ref!r}: cannot import {module_ref}: {exc}") from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{what} {ref!r}: {module_ref} has no {name!r}") from None


def load_file(path: Path) -> Any:
    """The Python file as a module, loaded once per process under a name made from its
    resolved path, and registered in `sys.modules` (dataclasses and pickle look themselves up
    there). A file that fails to import is a ValueError naming it."""
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    key = f"_rlgateway_user_{path.stem}_{digest}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[key]
        raise ValueError(f"{path} failed to import ({type(exc).__name__}: {exc})") from None
    return module
