"""Render a topology with confgen and run the real Envoy on the result."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from confgen import envoy, parse_topology
from confgen.output import write_tree
from confgen.runtime import EnvoyProcess


@contextmanager
def running_envoy(
    topology_yaml: str, out_dir: Path, secrets: Mapping[str, str] | None = None
) -> Iterator[EnvoyProcess]:
    topo, _ = parse_topology(topology_yaml.encode(), "test-topology.yaml")
    files = envoy.render(topo, config_dir=str(out_dir), secrets=secrets)
    write_tree(files, out_dir, rank=envoy.layout.write_rank)
    with EnvoyProcess(out_dir / "bootstrap.json") as proc:
        yield proc


def request(
    url: str,
    body: Any = None,
    headers: Mapping[str, str] | None = None,
    method: str | None = None,
    timeout: float = 10.0,
) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"))
    req.add_header("content-type", "application/json")
    for key, value in (headers or {}).items():
        req.add_header(key, value)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def request_from(
    source: str, port: int, body: Any, headers: Mapping[str, str] | None = None, path: str = "/v1/completions",
    timeout: float = 10.0,
) -> tuple[int, dict[str, str], bytes]:
    """POST `body` (JSON) to 127.0.0.1:`port` from the loopback address `source` (127.0.0.2 is a
    peer other than 127.0.0.1): status, headers, body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until it holds or `timeout` passes; bounded, returns the last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
