"""Output targets, found by name: one module per target, one line per target in `_MODULES`.

    get("nginx") -> Target      names() -> ("envoy", "nginx", "kubernetes", "compose", "gateway-api")

A `Target` is what the CLI and the verifier need of an output format: render the files,
list what the format cannot honour (warnings pinned to the topology), check the output
with the real proxy (where there is one), and the order files must be replaced in on a
live directory. The CLI, `confgen.verify` and `confgen.output` hold no target's name.

Adding a target: a module here defining `TARGET = Target(...)`, its line in `_MODULES`
(docs/architecture.md lists the rest: schema, docs, tests, goldens).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .._rejection import Refusal
from ..model import Topology

__all__ = ["Target", "get", "names", "verifiable"]

Finding = tuple[str, str]  # field path, message


def _nothing(_: Topology) -> list[Finding]:
    return []


def _by_name(rel: str) -> int:
    return 0


@dataclass(frozen=True, slots=True)
class Target:
    """One output format and what confgen does with it."""

    name: str
    # topology, config_dir (where the files live when read), API keys (None: placeholders) -> {path: bytes}
    render: Callable[[Topology, str, Mapping[str, str] | None], dict[str, bytes]]
    # what the target cannot honour: (field path, message) warnings
    warnings: Callable[[Topology], list[Finding]] = _nothing
    # what the target cannot render at all: (field path, message) errors; render and validate refuse
    refusals: Callable[[Topology], list[Finding]] = _nothing
    # the real proxy's check: (topology, check every endpoint) -> what it refused, [] when accepted
    verify: Callable[[Topology, bool], list[Refusal]] | None = None
    verify_help: str = ""
    # replacing files in a live directory: lower ranks first (then by path); removals in reverse
    write_rank: Callable[[str], int] = _by_name
    # the topology's own setting for where the files live (None: the output directory)
    config_dir: Callable[[Topology], str | None] = lambda _: None
    # whether rendering needs the API keys themselves (False: the output holds none)
    needs_keys: Callable[[Topology], bool] = lambda topo: topo.auth is not None


_MODULES: dict[str, str] = {
    "envoy": "confgen.targets.envoy",
    "nginx": "confgen.targets.nginx",
    "kubernetes": "confgen.targets.kubernetes",
    "compose": "confgen.targets.compose",
    "gateway-api": "confgen.targets.gateway_api",
}


def names() -> tuple[str, ...]:
    """Every target's name, the default (envoy) first."""
    return tuple(_MODULES)


def get(name: str) -> Target:
    """The target called `name`; KeyError when there is none."""
    target: Target = importlib.import_module(_MODULES[name]).TARGET
    return target


def verifiable() -> tuple[Target, ...]:
    """The targets with a real-proxy check, in registry order."""
    return tuple(t for t in map(get, names()) if t.verify is not None)
