"""One module per scenario; each exposes NAME, TITLE and run(ctx) -> Result."""

from __future__ import annotations

import importlib
from types import ModuleType

# The registry: a new scenario is one module here plus its name in ORDER (the run order).
ORDER = ("matrix", "prefix", "overload", "steady", "overhead", "failover", "reload", "sidecar_cost", "render_scale",
         "ads", "real_llama")


def load(name: str) -> ModuleType:
    if name not in ORDER:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(ORDER)}")
    return importlib.import_module(f"{__name__}.{name}")
