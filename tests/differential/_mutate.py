"""Hypothesis strategies that push the shipped topologies toward edge values.

A mutant starts from one of the examples or valid cases (parsed to plain data) and gets a
few mutations, each drawn from what the model says a field is: numbers at and around the
ends of their range, durations near Envoy's and nginx's limits, strings from each
pattern's unusual-but-allowed corners, long names, huge lists, many pools and workers,
and optional blocks (auth, limits, routes, canned answers) filled in with edge values.
References (route pools, fallbacks, allow lists, route models) are mostly drawn from what
the document already names, so that most mutants stay valid and reach the real proxies.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from hypothesis import strategies as st

from confgen._fields import COMPILED, Duration, spec_of, yaml_key
from confgen.model import Topology, Worker

ROOT = Path(__file__).resolve().parents[2]
BASES: dict[str, Any] = {
    p.relative_to(ROOT).as_posix(): yaml.safe_load(p.read_text())
    for p in sorted([*(ROOT / "examples").glob("*.yaml"), *(ROOT / "tests/cases/valid").glob("*/topology.yaml")])
}

DURATIONS = [
    "0s", "0ms", "1ms", "2ms", "49ms", "50ms", "51ms", "100ms", "999ms", "1001ms", "1500ms", "1s", "2s",
    "59s", "61s", "1m", "90s", "1h", "24h", "720h", "721h", "0.5s", "1.25s", "0.001s", "2.5m",
    "\u0665s", "5\u00b2s", "5 s", "5S", "-1s", "1d",
]
INTS = [-1, 0, 1, 2, 3, 99, 100, 101, 127, 128, 129, 255, 256, 1000, 1024, 4096, 65535, 65536,
        100_000, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 10**7, 10**9, 2**63]
FLOATS = [0.0, 0.01, 0.05, 0.1, 0.5, 1.0, 1.5, 2.0, 10.0, 99.99, 100.0, 100.5, 1e6]
ENGINES = ["vllm", "sglang", "tgi", "llamacpp", "openai"]

# Unusual but allowed strings per pattern (a few refused ones too: the loader must say so).
EDGE_STRINGS: dict[str, list[str]] = {
    "name": ["a", "0", "a" * 63, "a-b_c", "x" * 62 + "0", "a" * 64, "A", "-a", "a-"],
    "model": ["m", "a" * 128, "org/model:v1@rev+x", "M.9_-/:@+", "0", "a" * 129, "a b"],
    "header": ["x", "x-" + "a" * 62, "0", "a" * 64, "x-envoy-foo", "te", "host", "authorization",
               "content-type", "x-request-id", "cookie", "connection", "keep-alive"],
    "header_value": ["a", "A=b,c:d/e@f+g.h_i-j", "x" * 128, "x" * 129],
    "http_path": ["/", "/" + "a" * 255, "/v1/chat/completions", "/a.b_c~d-e/", "/a/../b", "//", "/%2F"],
    "env_var": ["A", "_", "a" * 128, "KEY_1"],
    "file_path": ["/a", "/run/secrets/k", "/" + "a" * 1023, "/a/../b"],
    "text": ["a", "x" * 512, "Busy (retry) now: ok!/_+-,.?", "x" * 513],
    "label": ["a", "a" * 63, "a.b/c_d-e", "a" * 64],
    "cookie": ["a", "_", "-", "a" * 64, "A-b_c"],
    "image": ["a", "reg.io/ns/img:tag", "img@sha256:" + "a" * 64],
    "scale_target": ["deployment/a", "statefulset/" + "a" * 63],
    "host": ["a", "a.b"],
}


_WORKER_ADDRESS = next(f for f in dataclasses.fields(Worker) if f.name == "address")


def _ipv4(i: int) -> str:
    return f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"


@st.composite
def worker_addresses(draw: st.DrawFn, count: int) -> list[str]:
    """`count` distinct worker addresses in one style (IPv4, IPv6 or DNS), edge ports."""
    style = draw(st.sampled_from(["v4", "v6", "dns", "mixed"]))
    port = draw(st.sampled_from([1, 80, 8000, 65535]))
    out = []
    for i in range(count):
        kind = style if style != "mixed" else ("v4", "v6", "dns")[i % 3]
        if kind == "v4":
            out.append(f"{_ipv4(i + 1)}:{port}")
        elif kind == "v6":
            out.append(f"[fd00::{i + 1:x}]:{port}")
        else:
            out.append(f"w-{i}.pool.svc.cluster.local:{port}")
    return out


def _pool_names(doc: dict[str, Any]) -> list[str]:
    return [p.get("name", "") for p in doc.get("pools", []) if isinstance(p, dict)]


def _clients(doc: dict[str, Any]) -> list[str]:
    auth = doc.get("auth")
    if not isinstance(auth, dict):
        return []
    return [k.get("client", "") for k in auth.get("api_keys", []) if isinstance(k, dict)]


def _served(doc: dict[str, Any], pool: str | None = None) -> list[str]:
    names: list[str] = []
    for p in doc.get("pools", []):
        if isinstance(p, dict) and (pool is None or p.get("name") == pool):
            names += [*p.get("models", []), *p.get("aliases", [])]
    return [n for n in names if isinstance(n, str)]


def _pattern_string(pattern: str | None) -> st.SearchStrategy[str]:
    if pattern is None:
        return st.sampled_from(["127.0.0.1", "0.0.0.0", "::", "::1", "10.0.0.1", "fd00::1", "1.2.3.4.5", "x"])
    edges = st.sampled_from(EDGE_STRINGS.get(pattern, ["a"]))
    if pattern == "host":
        return edges
    return st.one_of(edges, edges, st.from_regex(COMPILED[pattern], fullmatch=True))


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def value_for(draw: st.DrawFn, tp: Any, fld: dataclasses.Field[Any] | None, doc: dict[str, Any]) -> Any:
    """A YAML-able value for a field of type `tp`, biased to edges and to names in `doc`."""
    spec = spec_of(fld) if fld is not None else None
    name = fld.name if fld is not None else ""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if draw(st.integers(0, 9)) == 0:
            return None
        tp, origin = args[0], typing.get_origin(args[0])
    if name in ("pool", "fallback", "default_pool") and tp is str:
        return draw(st.sampled_from([*_pool_names(doc), "nope"] if _pool_names(doc) else ["nope"]))
    if name == "allow_clients":
        clients = _clients(doc)
        return draw(st.lists(st.sampled_from(clients), max_size=3, unique=True)) if clients else []
    if name == "models" and origin is list and fld is not None and fld.type == "list[str] | None":
        served = _served(doc)
        return draw(st.lists(st.sampled_from(served), min_size=1, max_size=3, unique=True)) if served else None
    if fld is not None and fld is _WORKER_ADDRESS:
        return draw(st.one_of(worker_addresses(1).map(lambda a: a[0]),
                              st.sampled_from(["127.0.0.1:\u0668\u0660", "127.0.0.1:\u00b2", "127.0.0.1:0",
                                               "127.0.0.1:65536", "[::1]:1", "a:1", "1.2.3.4:080"])))
    if origin is Literal:
        return draw(st.sampled_from([str(c) for c in typing.get_args(tp)]))
    if origin is list:
        (item,) = typing.get_args(tp)
        size = draw(st.sampled_from([0, 1, 2, 3]))
        pattern = spec.pattern if spec else None
        return [draw(_pattern_string(pattern)) if item is str else value_for(draw, item, fld, doc) for _ in range(size)]
    if origin is dict:
        keys = draw(st.lists(_pattern_string("label"), max_size=3, unique=True))
        return {k: draw(_pattern_string("label")) for k in keys}
    if tp is bool:
        return draw(st.booleans())
    if tp is int:
        edges = list(INTS)
        if spec is not None:
            lo, hi = spec.minimum, spec.maximum
            if isinstance(lo, int | float) and isinstance(hi, int | float):
                edges += [int(lo), int(hi), int(lo) + 1, int(hi) - 1]
                return draw(st.one_of(st.sampled_from(edges), st.integers(int(lo), int(hi)),
                                      st.sampled_from([int(lo), int(hi)])))
        return draw(st.sampled_from(edges))
    if tp is float:
        edges = list(FLOATS)
        if spec is not None and isinstance(spec.minimum, int | float) and isinstance(spec.maximum, int | float):
            edges += [float(spec.minimum), float(spec.maximum)]
            return draw(st.one_of(st.sampled_from(edges),
                                  st.floats(float(spec.minimum), float(spec.maximum), allow_nan=False)))
        return draw(st.sampled_from(edges))
    if tp is Duration:
        return draw(st.one_of(st.sampled_from(DURATIONS),
                              st.builds(lambda n, u: f"{n}{u}", st.integers(0, 100_000), st.sampled_from(["ms", "s"]))))
    if tp is str:
        return draw(_pattern_string(spec.pattern if spec else None))
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return build(draw, tp, doc)
    raise TypeError(tp)


def build(draw: st.DrawFn, cls: type, doc: dict[str, Any]) -> Any:
    """A whole object of `cls`: every required field, some optional ones, edge values."""
    if cls is Worker:
        return draw(worker_addresses(1))[0] if draw(st.booleans()) else {"address": draw(worker_addresses(1))[0]}
    hints = _hints(cls)
    out: dict[str, Any] = {}
    for fld in dataclasses.fields(cls):
        required = fld.default is dataclasses.MISSING and fld.default_factory is dataclasses.MISSING
        if required or draw(st.integers(0, 3)) == 0:
            out[yaml_key(fld)] = value_for(draw, hints[fld.name], fld, doc)
    return out


def _sites(doc: Any, cls: type, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], type]]:
    """Every mapping in `doc` that stands for a model object, with its class."""
    if not isinstance(doc, dict):
        return []
    out = [(path, cls)]
    hints = _hints(cls)
    for fld in dataclasses.fields(cls):
        key = yaml_key(fld)
        tp = hints[fld.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) in (Union, types.UnionType):
            tp = args[0]
        value = doc.get(key)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type) and isinstance(value, dict):
            out += _sites(value, tp, (*path, key))
        elif typing.get_origin(tp) is list and isinstance(value, list):
            (item,) = typing.get_args(tp)
            if dataclasses.is_dataclass(item) and isinstance(item, type):
                for index, child in enumerate(value):
                    out += _sites(child, item, (*path, key, index))
    return out


def _at(doc: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        doc = doc[step]
    return doc


def _set_field(draw: st.DrawFn, doc: dict[str, Any]) -> str:
    sites = _sites(doc, Topology)
    path, cls = draw(st.sampled_from(sites))
    target = _at(doc, path)
    fields = [f for f in dataclasses.fields(cls) if f.name not in ("version",)]
    fld = draw(st.sampled_from(fields))
    value = value_for(draw, _hints(cls)[fld.name], fld, doc)
    if value is None and fld.default is not None:
        target.pop(yaml_key(fld), None)
    else:
        target[yaml_key(fld)] = value
    return f"set {'.'.join(map(str, path))}.{yaml_key(fld)}"


def _pools(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The document's pools when an earlier mutation left some (it may have set `pools: []`)."""
    pools = doc.get("pools")
    return pools if isinstance(pools, list) and pools and all(isinstance(p, dict) for p in pools) else []


def _grow_workers(draw: st.DrawFn, doc: dict[str, Any]) -> str:
    pools = _pools(doc)
    if not pools:
        return "no pools"
    index = draw(st.integers(0, len(pools) - 1))
    count = draw(st.sampled_from([1, 2, 9, 64, 320, 330, 400, 1000, 2500]))
    pools[index]["workers"] = draw(worker_addresses(count))
    if draw(st.booleans()):
        pools[index]["capacity"] = draw(st.sampled_from([1, 256, 4096, 100_000]))
    return f"workers x{count}"


def _grow_pools(draw: st.DrawFn, doc: dict[str, Any]) -> str:
    count = draw(st.sampled_from([2, 10, 60, 101, 130]))
    if not _pools(doc):
        return "no pools"
    base = copy.deepcopy(doc["pools"][0])
    base.pop("fallback", None)
    base.pop("autoscale", None)
    for i in range(count):
        pool = copy.deepcopy(base)
        pool["name"] = f"g{i}"
        pool["models"] = [f"gm{i}"]
        pool.pop("aliases", None)
        doc["pools"].append(pool)
    if count > 99 and draw(st.booleans()):
        doc.setdefault("envoy", {})["max_eds_files"] = count + 10
    return f"pools +{count}"


def _grow_models(draw: st.DrawFn, doc: dict[str, Any]) -> str:
    pools = _pools(doc)
    if not pools:
        return "no pools"
    index = draw(st.integers(0, len(pools) - 1))
    count = draw(st.sampled_from([1, 30, 59, 61, 100, 300]))
    width = draw(st.sampled_from([1, 20, 128]))
    pools[index]["models"] = [f"{i:0{width}d}"[:128] if width > 1 else f"m{i}" for i in range(count)]
    pools[index].pop("aliases", None)
    return f"models x{count}"


def _rename_pool(draw: st.DrawFn, doc: dict[str, Any]) -> str:
    pools = _pools(doc)
    if not pools:
        return "no pools"
    index = draw(st.integers(0, len(pools) - 1))
    old = pools[index]["name"]
    new = draw(st.sampled_from(["p" * 63, "0", "a_b-c", "z" + "9" * 62]))
    if new in _pool_names(doc):
        return "rename skipped"
    pools[index]["name"] = new
    for p in pools:
        if p.get("fallback") == old:
            p["fallback"] = new
    for r in doc.get("routes", []) or []:
        if isinstance(r, dict) and r.get("pool") == old:
            r["pool"] = new
    if doc.get("default_pool") == old:
        doc["default_pool"] = new
    return f"rename {old}"


def _add_auth(draw: st.DrawFn, doc: dict[str, Any]) -> str:
    from confgen.model import Auth

    doc["auth"] = {
        "api_keys": [{"client": f"c{i}", "env": f"KEY_{i}"} for i in range(draw(st.sampled_from([1, 2, 40])))],
    }
    if draw(st.booleans()):
        fld = next(f for f in dataclasses.fields(Auth) if f.name == "client_header")
        doc["auth"]["client_header"] = value_for(draw, str, fld, doc)
    return "auth"


def _add_block(draw: st.DrawFn, doc: dict[str, Any]) -> str:
    from confgen.model import Canned, Limits, Route

    which = draw(st.sampled_from(["limits", "routes", "last_resort", "per_key"]))
    if which == "limits":
        doc["limits"] = build(draw, Limits, doc)
    elif which == "per_key" and _clients(doc):
        for key in doc["auth"]["api_keys"]:
            if draw(st.booleans()):
                from confgen.model import RateLimit

                key["rate_limit"] = build(draw, RateLimit, doc)
    elif which == "routes":
        doc["routes"] = [build(draw, Route, doc) for _ in range(draw(st.integers(1, 3)))]
        for i, route in enumerate(doc["routes"]):
            route["name"] = f"r{i}"
            route.setdefault("match", {})
            if isinstance(route["match"], dict) and draw(st.booleans()):
                served = _served(doc, route.get("pool"))
                route["match"] = {"models": served[:2]} if served else {}
    else:
        doc["last_resort"] = build(draw, Canned, doc)
    return which


MUTATIONS = [_set_field, _set_field, _set_field, _set_field, _grow_workers, _grow_pools, _grow_models,
             _rename_pool, _add_auth, _add_block, _add_block]


@st.composite
def mutants(draw: st.DrawFn) -> tuple[str, list[str], str]:
    """(base file, mutations applied, YAML text) of one mutant."""
    base = draw(st.sampled_from(sorted(BASES)))
    doc = copy.deepcopy(BASES[base])
    applied = []
    for _ in range(draw(st.integers(1, 4))):
        mutation = draw(st.sampled_from(MUTATIONS))
        applied.append(mutation(draw, doc))
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=10_000)
    return base, applied, text
