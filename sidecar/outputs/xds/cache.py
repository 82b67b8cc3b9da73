"""The resources the control plane serves, with versions, and a signal when they change.

A resource's version is a hash of its canonical JSON (sorted keys), a type's version a
hash of its resources' names and versions: two control planes with the same view send the
same versions, and a re-render that changes nothing changes no version.

JSON is turned into protobuf with `json_format.ParseDict` into an `Any`, which needs every
"@type" (the resource's and its nested typed_configs') in the descriptor pool: the
generated modules of each such package are imported once, on first sight. A nested typed
config whose type the generated modules do not have (an API newer than them: Envoy 1.40's
sse_to_metadata is not in xds-protos 1.85) is sent as an `xds.type.v3.TypedStruct` of the
same JSON, which Envoy turns into its own message with its own descriptors (and refuses, as
it would the message, when it is not valid there).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import json
import pkgutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf import any_pb2, descriptor_pool, json_format

from confgen.errors import ConfgenError

__all__ = ["CDS", "ECDS", "EDS", "LDS", "RTDS", "TYPE_ORDER", "Packer", "Resource", "XdsCache", "XdsResourceError"]

_PREFIX = "type.googleapis.com/"
LDS = _PREFIX + "envoy.config.listener.v3.Listener"
CDS = _PREFIX + "envoy.config.cluster.v3.Cluster"
EDS = _PREFIX + "envoy.config.endpoint.v3.ClusterLoadAssignment"
RTDS = _PREFIX + "envoy.service.runtime.v3.Runtime"
ECDS = _PREFIX + "envoy.config.core.v3.TypedExtensionConfig"  # the API keys, apart from the listeners
# Make before break: clusters before their endpoints, both (and the filters' configs) before the
# listeners routing through them.
TYPE_ORDER = (CDS, EDS, ECDS, LDS, RTDS)
_TYPED_STRUCT = "xds.type.v3.TypedStruct"  # what Envoy turns into any typed config it knows
SHORT = {CDS: "cds", EDS: "eds", ECDS: "ecds", LDS: "lds", RTDS: "rtds"}


class XdsResourceError(ConfgenError, ValueError):
    """A resource that cannot be expressed as Envoy's protobuf (a renderer bug)."""


class Packer:
    """JSON -> protobuf Any, importing the generated modules of each "@type" package once."""

    def __init__(self) -> None:
        self._loaded: set[str] = set()

    def _import_package(self, full_name: str) -> None:
        package = full_name.rpartition(".")[0]
        if package in self._loaded:
            return
        try:
            module = importlib.import_module(package)
        except ImportError as exc:
            raise XdsResourceError(f"no generated module for {full_name}") from exc
        for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
            if info.name.endswith("_pb2"):
                importlib.import_module(f"{package}.{info.name}")
        self._loaded.add(package)

    def known(self, full_name: str) -> bool:
        """Whether the generated modules have the message `full_name` (imported on first sight)."""
        try:
            self._import_package(full_name)
            descriptor_pool.Default().FindMessageTypeByName(full_name)
        except (XdsResourceError, KeyError):
            return False
        return True

    def to_any(self, resource: Mapping[str, Any]) -> any_pb2.Any:
        """A typed JSON resource ("@type" at its top) as a protobuf Any."""
        kind = str(resource.get("@type", ""))
        if kind.startswith(_PREFIX):
            self._import_package(kind[len(_PREFIX):])
        body = {k: self._opaque(v) for k, v in resource.items()}
        self._import_package(_TYPED_STRUCT)
        for name in set(_types(body)):
            self._import_package(name)
        packed = any_pb2.Any()
        try:
            json_format.ParseDict(body, packed)
        except json_format.ParseError as exc:
            raise XdsResourceError(str(exc)) from exc
        return packed

    def _opaque(self, node: Any) -> Any:
        """`node` with every typed config of a type the generated modules lack as a TypedStruct."""
        if isinstance(node, list):
            return [self._opaque(item) for item in node]
        if not isinstance(node, dict):
            return node
        kind = node.get("@type")
        if isinstance(kind, str) and kind.startswith(_PREFIX) and not self.known(kind[len(_PREFIX):]):
            return {"@type": _PREFIX + _TYPED_STRUCT, "type_url": kind,
                    "value": {k: v for k, v in node.items() if k != "@type"}}
        return {k: self._opaque(v) for k, v in node.items()}


def _types(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        kind = node.get("@type")
        if isinstance(kind, str) and kind.startswith(_PREFIX):
            yield kind[len(_PREFIX):]
            if kind == _PREFIX + _TYPED_STRUCT:
                return  # its value is a Struct (JSON), typed by Envoy
        for value in node.values():
            yield from _types(value)
    elif isinstance(node, list):
        for item in node:
            yield from _types(item)


def canonical(resource: Mapping[str, Any]) -> bytes:
    return json.dumps(resource, separators=(",", ":"), sort_keys=True, ensure_ascii=True).encode()


@dataclass(frozen=True, slots=True)
class Resource:
    name: str
    version: str
    body: any_pb2.Any


def _version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def type_version(resources: Iterable[Resource]) -> str:
    digest = hashlib.sha256()
    for res in sorted(resources, key=lambda r: r.name):
        digest.update(f"{res.name}\0{res.version}\n".encode())
    return digest.hexdigest()[:16]


class XdsCache:
    """Resources by type and name; `changed` wakes every stream after an update."""

    def __init__(self) -> None:
        self._resources: dict[str, dict[str, Resource]] = {t: {} for t in TYPE_ORDER}
        self._versions: dict[str, str] = {t: type_version(()) for t in TYPE_ORDER}
        self._generation = 0
        self._listeners: set[asyncio.Event] = set()
        self._primed = False
        self._packer = Packer()
        self.updates: dict[str, int] = dict.fromkeys(TYPE_ORDER, 0)

    @property
    def generation(self) -> int:
        return self._generation

    def version(self, type_url: str) -> str:
        return self._versions[type_url]

    def resources(self, type_url: str) -> Mapping[str, Resource]:
        return self._resources[type_url]

    def prepare(self, type_url: str, bodies: Mapping[str, Mapping[str, Any]]) -> dict[str, Resource]:
        """Every resource of a type, parsed into protobuf (reusing unchanged ones); no change yet.

        The costly part of replacing a type, safe to run in a worker thread while the event
        loop serves (it reads the cache, never writes it)."""
        current = self._resources[type_url]
        new: dict[str, Resource] = {}
        for name, body in bodies.items():
            version = _version(canonical(body))
            old = current.get(name)
            new[name] = old if old is not None and old.version == version else Resource(
                name, version, self._packer.to_any(body))
        return new

    def install(self, type_url: str, prepared: dict[str, Resource]) -> bool:
        """Make `prepared` (from `prepare`) the type's resources; True when anything changed."""
        current = self._resources[type_url]
        if prepared.keys() == current.keys() and all(prepared[n].version == current[n].version for n in prepared):
            return False
        self._resources[type_url] = prepared
        self._bump(type_url)
        return True

    def set_all(self, type_url: str, bodies: Mapping[str, Mapping[str, Any]]) -> bool:
        """Replace every resource of a type; True when anything changed."""
        return self.install(type_url, self.prepare(type_url, bodies))

    def set_one(self, type_url: str, name: str, body: Mapping[str, Any]) -> bool:
        """Add or replace one resource; True when it changed."""
        version = _version(canonical(body))
        old = self._resources[type_url].get(name)
        if old is not None and old.version == version:
            return False
        self._resources[type_url][name] = Resource(name, version, self._packer.to_any(body))
        self._bump(type_url)
        return True

    def remove(self, type_url: str, name: str) -> bool:
        if self._resources[type_url].pop(name, None) is None:
            return False
        self._bump(type_url)
        return True

    def _bump(self, type_url: str) -> None:
        self._versions[type_url] = type_version(self._resources[type_url].values())
        self.updates[type_url] += 1
        self._generation += 1
        for event in self._listeners:
            event.set()

    @property
    def primed(self) -> bool:
        """True once a whole configuration is in (before that, streams answer nothing)."""
        return self._primed

    def prime(self) -> None:
        if not self._primed:
            self._primed = True
            for event in self._listeners:
                event.set()

    def listen(self, event: asyncio.Event) -> asyncio.Event:
        """Set `event` on every change from now on (and once now: a new stream has everything to send)."""
        self._listeners.add(event)
        event.set()
        return event

    def unlisten(self, event: asyncio.Event) -> None:
        self._listeners.discard(event)
