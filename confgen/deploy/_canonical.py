"""The model written back as YAML: the canonical topology a ConfigMap carries.

Produced by yaml.safe_dump from plain data, so it re-loads through `topology.load` to the
same model and no value can change its structure. Fields equal to their default are left
out, so it reads like a hand-written topology.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from .._fields import Duration, yaml_key
from ..model import Topology


def _default_of(fld: dataclasses.Field[Any]) -> Any:
    if fld.default is not dataclasses.MISSING:
        return fld.default
    if fld.default_factory is not dataclasses.MISSING:
        return fld.default_factory()
    return dataclasses.MISSING


def plain(value: Any) -> Any:
    if isinstance(value, Duration):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for fld in dataclasses.fields(value):
            item = getattr(value, fld.name)
            if item is None or item == _default_of(fld):
                continue
            out[yaml_key(fld)] = plain(item)
        return out
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


class Dumper(yaml.SafeDumper):
    """safe_dump without anchors/aliases, with multi-line strings as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


Dumper.add_representer(str, _str)


def dump(data: Any) -> str:
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, default_flow_style=False)


def topology_yaml(topo: Topology) -> str:
    return dump(plain(topo))
