"""One exception tree: every public exception confgen and the sidecar define is a ConfgenError."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import confgen
import sidecar
from confgen.errors import ConfgenError, Diagnostic, Severity, TopologyError
from sidecar.config import ConfigError, SidecarConfig, xds_dir_for


def _modules() -> list[str]:
    names = []
    for package in (confgen, sidecar):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not info.name.endswith("__main__"):
                names.append(info.name)
    return names


def test_every_public_exception_is_a_confgen_error() -> None:
    """Walking every module of both packages, each exception class without a leading
    underscore (the private ones are internal control flow, never raised to a caller)
    derives from ConfgenError, so a caller catches one base and nothing broader."""
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and not attr.startswith("_") \
                    and value.__module__.startswith(("confgen", "sidecar")):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    assert len(found) >= 10, sorted(found)  # the walk sees the tree
    outside = sorted(name for name, cls in found.items() if not issubclass(cls, ConfgenError))
    assert outside == []


def test_severity_is_typed_and_prints_as_before() -> None:
    """Severity is an Enum whose members still print and compare as "error" / "warning"."""
    diag = Diagnostic("t.yaml", 3, 5, "pools[0]", "bad", Severity.WARNING)
    assert str(diag) == "t.yaml:3:5: pools[0]: warning: bad"
    assert Severity.ERROR == "error" and f"{Severity.WARNING}" == "warning"
    assert str(TopologyError([Diagnostic("t.yaml", 1, 1, "", "boom")])) == "t.yaml:1:1: <document>: boom"


def test_no_xds_dir_is_a_config_error_not_any_value_error(tmp_path: Path) -> None:
    """Without --xds-dir and without envoy.config_dir the sidecar's error is a ConfigError
    (what main reports as startup.no_xds_dir), not a bare ValueError it might confuse with
    another."""
    from confgen.topology import parse

    topo, _ = parse(b"version: 1\nname: t\nlisteners: [{name: l, port: 8080}]\n"
                    b"pools: [{name: p, engine: vllm, models: [m], workers: ['10.0.0.1:8000']}]\n")
    with pytest.raises(ConfigError, match="no xDS directory"):
        xds_dir_for(SidecarConfig(topology=tmp_path / "t.yaml"), topo)
    assert xds_dir_for(SidecarConfig(topology=tmp_path / "t.yaml", xds_dir=tmp_path), topo) == tmp_path
