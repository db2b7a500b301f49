"""Run a function on a module as soon as it is imported (or now, if it already is): how the
observer and the CPU shims reach verl's and vLLM's modules without importing them in processes
that never use them (the driver never serves a model; a vLLM engine core never trains)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType

_waiting: dict[str, list[Callable[[ModuleType], None]]] = {}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        for callback in _waiting.pop(module.__name__, []):
            callback(module)


_FINDER = _Finder()


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """`callback(module)` once `name` is imported: now when it already is."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    _waiting.setdefault(name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
