"""Injection: no string field of the model accepts a character that has structure in an
Envoy, Nginx or shell file. A complete topology that sets every string field is mutated
one field at a time; each mutation must fail with that field's path and place."""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union

import pytest
import yaml

from confgen import model, verify
from confgen._decode import _hints
from confgen._fields import Duration, yaml_key
from confgen.errors import TopologyError
from confgen.topology import parse
from tests.support.certs import CertAuthority

# Sets every string-typed field of the model at least once (checked below).
FULL: dict[str, Any] = {
    "version": 1,
    "name": "full",
    "admin": {"address": "127.0.0.1", "port": 9901},
    "sidecar": {"address": "127.0.0.1", "port": 9109, "models": True, "grpc_socket_dir": "/run/confgen-full",
                "grpc_tls": {"cert": "/etc/envoy/grpc/tls.crt", "key": "/etc/envoy/grpc/tls.key",
                             "ca": "/etc/envoy/grpc/ca.crt", "server_names": ["sidecar.example"]}},
    "envoy": {"config_dir": "/etc/confgen/envoy", "node_id": "edge-1",
              "xds": {"mode": "files", "servers": ["cp-0.example:18000", "[::1]:18001"], "protocol": "delta"}},
    "nginx": {"config_dir": "/etc/confgen/nginx"},
    "kubernetes": {
        "namespace": "inference",
        "envoy_image": "envoyproxy/envoy:v1.40.0",
        "sidecar_image": "registry.example/confgen/sidecar:0.1.0",
        "keys_secret": "confgen-keys",
        "monitoring": True,
        "admin_token_secret": "confgen-sidecar-token",
        "prometheus_url": "http://prometheus.monitoring.svc:9090",
        "monitoring_labels": {"release": "kube-prometheus-stack"},
        "redis_image": "redis:7.2-alpine",
        "gateway": "inference-gateway",
    },
    "listeners": [{"name": "public", "port": 8080, "address": "0.0.0.0",
                   "trusted_headers": {"names": ["x-tier"], "from": ["10.0.0.0/8"]}}],
    "auth": {
        "client_header": "x-client",
        "api_keys": [
            {"client": "web", "env": "CONFGEN_KEY_WEB", "class": "critical"},
            {"client": "batch", "file": "/run/secrets/batch-key"},
        ],
    },
    "default_pool": "big",
    "routes": [
        {
            "name": "tiered",
            "pool": "small",
            "allow_clients": ["web"],
            "class": "sheddable",
            "match": {
                "models": ["chat"],
                "path_prefix": "/v1/chat",
                "headers": [{"name": "x-tier", "exact": "small"}, {"name": "x-region", "prefix": "eu-"}],
            },
        }
    ],
    "pools": [
        {
            "name": "big",
            "engine": "vllm",
            "models": ["meta-llama/Llama-3.1-70B-Instruct"],
            "aliases": ["chat"],
            "fallback": "small",
            "discovery": "eds",
            "metrics_path": "/metrics",
            "allow_clients": ["web", "batch"],
            "balancing": {"policy": "ring_hash", "hash_on": {"header": "x-session-id"}},
            "health": {"path": "/health"},
            "retries": {"retry_on": ["connect-failure", "reset"]},
            "autoscale": {"target": "statefulset/vllm-big"},
            "pod_labels": {"app": "vllm-big"},
            "workers": [
                {"address": "10.0.0.1:8000", "zone": "rack-a", "labels": {"gpu": "a100"}},
                "10.0.0.2:8000",
            ],
        },
        {
            "name": "small",
            "engine": "sglang",
            "models": ["small-model"],
            "aliases": ["chat"],
            "balancing": {"policy": "maglev", "hash_on": {"cookie": "session"}},
            "workers": ["10.0.0.3:8000"],
        },
    ],
    "last_resort": {"kind": "error", "status": 503, "message": "Busy. Retry shortly."},
    "limits": {
        "per_key": [{"requests": 10, "per": "1s"},
                    {"scope": "global", "unit": "total_tokens", "tokens": 100000, "window": "minute"}],
        "store": {"redis": "redis.example:6379", "username": "confgen", "password_env": "CONFGEN_REDIS_PASSWORD"},
    },
}

BAD_CHARS = ["\n", ";", "{", "}", "#", "\x00", "$", '"', "'", "\\"]
Path_ = tuple[str | int, ...]


def _unwrap(tp: Any) -> Any:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _is_text(tp: Any) -> bool:
    return tp is str or typing.get_origin(tp) is Literal


def _leaves(value: Any, tp: Any, path: Path_, owner: tuple[type, str] | None) -> Iterator[tuple[Path_, str, Any]]:
    """(path, kind, owner) for every string in `value`; kind is 'value', 'key' or 'shorthand'."""
    if typing.get_origin(tp) in (Union, types.UnionType) and isinstance(value, list):  # X | list[X]
        tp = next(a for a in typing.get_args(tp) if typing.get_origin(a) is list)
    tp = _unwrap(tp)
    origin = typing.get_origin(tp)
    if tp is Duration:
        return
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, str):  # worker shorthand
            shorthand = tp.__shorthand__  # type: ignore[attr-defined]
            yield path, "shorthand", (tp, shorthand)
            return
        fields = {yaml_key(f): f for f in dataclasses.fields(tp)}
        for key, sub in value.items():
            fld = fields[key]
            yield from _leaves(sub, _hints(tp)[fld.name], (*path, key), (tp, fld.name))
    elif origin is list:
        for index, item in enumerate(value):
            yield from _leaves(item, typing.get_args(tp)[0], (*path, index), owner)
    elif origin is dict:
        for key in value:
            yield (*path, key), "key", owner
            yield (*path, key), "value", owner
    elif _is_text(tp):
        yield path, "value", owner


def _text_fields(cls: type, seen: set[type] | None = None) -> set[tuple[type, str]]:
    """Every (dataclass, field) of the model whose type holds strings."""
    seen = seen if seen is not None else set()
    if cls in seen:
        return set()
    seen.add(cls)
    found: set[tuple[type, str]] = set()
    for fld in dataclasses.fields(cls):
        tp = _unwrap(_hints(cls)[fld.name])
        while typing.get_origin(tp) is list:
            tp = _unwrap(typing.get_args(tp)[0])
        if typing.get_origin(tp) is dict or _is_text(tp):
            found.add((cls, fld.name))
        elif dataclasses.is_dataclass(tp) and isinstance(tp, type):
            found |= _text_fields(tp, seen)
        else:
            assert tp in (int, float, bool, Duration), (cls, fld.name, tp)
    return found


# Fields that exclude one another come from a second base: FULL with the store behind Sentinels
# (limits.store.sentinel instead of limits.store.redis); only its leaves under limits.store.
FULL_SENTINEL: dict[str, Any] = {**FULL, "limits": {**FULL["limits"], "store": {
    "sentinel": {"addresses": ["sentinel-0.example:26379", "sentinel-1.example:26379", "sentinel-2.example:26379"],
                 "master": "limits"}}}}
# ... and FULL with Envoy's admin on a socket of its own (admin.socket instead of admin.address and port).
FULL_SOCKET: dict[str, Any] = {**FULL, "admin": {"socket": "/run/confgen-full/envoy-admin.sock"}}
LEAVES = [(FULL, *leaf) for leaf in _leaves(FULL, model.Topology, (), None)] + [
    (FULL_SENTINEL, *leaf) for leaf in _leaves(FULL_SENTINEL, model.Topology, (), None)
    if leaf[0][:2] == ("limits", "store")] + [
    (FULL_SOCKET, *leaf) for leaf in _leaves(FULL_SOCKET, model.Topology, (), None) if leaf[0][:1] == ("admin",)]


def _path_text(path: Path_, kind: str, key: str | None = None) -> str:
    out = ""
    for part in path if kind != "key" else path[:-1]:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    if kind == "key":
        out += f"[{key!r}]"
    if kind == "shorthand":
        out += ".address"
    return out


def _node_at(root: yaml.Node, path: Path_, kind: str) -> yaml.Node:
    node = root
    for depth, part in enumerate(path):
        if isinstance(node, yaml.ScalarNode):  # shorthand worker: the string is the address
            return node
        if isinstance(part, int):
            node = node.value[part]
            continue
        for key_node, value_node in node.value:
            if key_node.value == part:
                last = depth == len(path) - 1
                node = key_node if (last and kind == "key") else value_node
                break
        else:
            raise KeyError(part)
    return node


def _mutate(doc: dict[str, Any], path: Path_, kind: str, suffix: str) -> tuple[dict[str, Any], str | None]:
    doc = copy.deepcopy(doc)
    parent: Any = doc
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if kind == "key":
        new_key = f"{last}{suffix}"
        parent[new_key] = parent.pop(last)
        return doc, new_key
    parent[last] = f"{parent[last]}{suffix}"
    return doc, None


def _dump(doc: dict[str, Any]) -> str:
    return yaml.dump(doc, Dumper=yaml.CSafeDumper, sort_keys=False, width=1000)


def test_full_topology_is_valid_and_covers_every_string_field(tmp_path: Path) -> None:
    """The base of the injection test is valid (real Envoy accepts it), and it sets every
    str, Literal, list-of-str and dict-of-str field the model has, so no field is missed.
    Envoy reads sidecar.grpc_tls's files when it validates: real ones from a throwaway CA."""
    topo, _ = parse(_dump(FULL).encode(), "full.yaml")
    parse(_dump(FULL_SENTINEL).encode(), "full-sentinel.yaml")
    parse(_dump(FULL_SOCKET).encode(), "full-socket.yaml")
    covered = {owner for _, _, _, owner in LEAVES}
    assert _text_fields(model.Topology) - covered == set()
    doc = copy.deepcopy(FULL)
    ca = CertAuthority.create(tmp_path / "pki")
    client = ca.issue("full-envoy")
    doc["sidecar"]["grpc_tls"] = {"cert": str(client.cert), "key": str(client.key), "ca": str(ca.cert)}
    topo, _ = parse(_dump(doc).encode(), "full.yaml")
    assert verify.verify(topo, "envoy") == []


@pytest.mark.parametrize("char", BAD_CHARS, ids=repr)
def test_every_string_field_refuses_structural_characters(char: str) -> None:
    """Each string field (values and mapping keys), given a value containing `char`, makes
    loading fail with exactly one error at that field's path, line and column."""
    problems: list[object] = []
    for base, path, kind, _ in LEAVES:
        doc, new_key = _mutate(base, path, kind, f"{char}x")
        text = _dump(doc)
        assert yaml.load(text, Loader=yaml.CSafeLoader) == doc  # the character really reaches the field
        root = yaml.compose(text, Loader=yaml.CSafeLoader)
        assert root is not None
        node = _node_at(root, path[:-1] + ((new_key,) if new_key else path[-1:]), kind)
        expected_path = _path_text(path, kind, new_key)
        try:
            parse(text.encode(), "inj.yaml")
        except TopologyError as exc:
            got = [(d.path, d.line, d.col) for d in exc.diagnostics if d.severity == "error"]
            want = [(expected_path, node.start_mark.line + 1, node.start_mark.column + 1)]
            if got != want:
                problems.append((expected_path, got, want))
        else:
            problems.append((expected_path, "accepted"))
    assert problems == []


def test_raw_nul_byte_in_any_string_field_fails_at_the_reader() -> None:
    """A raw NUL byte written into any string field makes the whole file fail before YAML
    parsing, reported at the NUL's own line and column."""
    marker = "QQNULQQ"
    for base, path, kind, _ in LEAVES:
        doc, _ = _mutate(base, path, kind, marker)
        text = _dump(doc)
        assert text.count(marker) == 1
        offset = text.index(marker)
        line = text.count("\n", 0, offset) + 1
        col = offset - (text.rfind("\n", 0, offset) + 1) + 1
        raw = text.replace(marker, "\x00").encode()
        with pytest.raises(TopologyError) as info:
            parse(raw, "nul.yaml")
        assert [str(d) for d in info.value.diagnostics] == [f"nul.yaml:{line}:{col}: <document>: NUL byte in file"], (
            path
        )
