"""Names a package exports but imports on first use (PEP 562).

`import arborspec` used to import the engine, torch and transformers' modeling code: 4-5 s on a 2-core Zen 4 host,
paid by `arborspec --help` and `arborspec models list` too. A package that lists its exports here imports each one's
module when the name is first read, then keeps it as a plain attribute.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package`: name -> the submodule (relative, e.g. "core.tree") that defines it."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        namespace[name] = value
        return value

    return __getattr__
