"""Envoy and nginx route the same request to the same pool (docs/targets.md, "How the
body's model is read"): the same Content-Types let the body be read, the same `model`
values name a model, on the real proxies in front of the same two backends."""

from __future__ import annotations

import http.client
from pathlib import Path

from confgen.runtime import free_port
from tests.nginx._support import running_nginx
from tests.support.backends import backends
from tests.support.envoy import running_envoy, wait_until

TOPOLOGY = """
version: 1
name: body-routing
admin: {{address: 127.0.0.1, port: {admin}}}
listeners: [{{name: public, address: 127.0.0.1, port: {port}}}]
default_pool: small
pools:
  - name: big
    engine: vllm
    models: [big-model, "5", "1", "true"]
    health: {{enabled: false}}
    workers: ["127.0.0.1:{a}"]
  - name: small
    engine: vllm
    models: [small-model]
    health: {{enabled: false}}
    workers: ["127.0.0.1:{b}"]
"""

BIG = b'{"model":"big-model","prompt":"hi"}'
# (Content-Type or None, body, where it must go: "a" = pool big, "b" = the default pool, 404)
CASES: list[tuple[str | None, bytes, str | int]] = [
    ("application/json", BIG, "a"),
    ("application/json; charset=utf-8", BIG, "a"),
    ("application/json;charset=UTF-8", BIG, "a"),
    (None, BIG, "a"),  # no Content-Type: read as JSON, as the engines do
    ("", BIG, "a"),
    ("text/plain", BIG, "b"),  # not JSON: routed as naming no model
    ("application/x-www-form-urlencoded", BIG, "b"),  # curl -d without -H
    ("Application/JSON", BIG, "b"),
    ("application/vnd.api+json", BIG, "b"),
    ("application/json; charset=latin-1", BIG, "b"),
    ("application/json", b'{"model":"small-model"}', "b"),
    ("application/json", b'{"model":"nope"}', 404),
    ("application/json", b'{"model":""}', 404),
    ("application/json", b'{"model":"BIG-MODEL"}', 404),
    ("application/json", b'{"model":5}', 404),  # a number names no model, even with a pool serving "5"
    ("application/json", b'{"model":true}', 404),  # Envoy's STRING would have made this "1"
    ("application/json", b'{"model":1.5}', 404),
    ("application/json", b'{"model":null}', "b"),
    ("application/json", b'{"model":["big-model"]}', "b"),
    ("application/json", b'{"model":{"id":"big-model"}}', "b"),
    ("application/json", b'["big-model"]', "b"),
    ("application/json", b'{"model":"big-model",', "b"),  # not JSON
    ("application/json", b'{"model":"big-model"} x', "b"),  # trailing bytes
    ("application/json", b"", "b"),
    ("application/json", b'{"model":"small-model","model":"big-model"}', "a"),  # the last key wins
    ("application/json", b'{"model":"big\\u002dmodel"}', "a"),  # JSON escapes are decoded
    ("application/json", b' \n{"model":"big-model"}\n', "a"),
]


def _send(port: int, content_type: str | None, body: bytes) -> str | int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        headers = {} if content_type is None else {"content-type": content_type}
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        backend = resp.getheader("x-backend")
        return backend if resp.status == 200 and backend else resp.status
    finally:
        conn.close()


def test_envoy_and_nginx_route_every_body_alike(tmp_path: Path) -> None:
    """Each request of the table reaches the same place through the real Envoy and the real
    nginx, and that place is the documented one (JSON Content-Types only, string models
    only, the default pool for a body naming no model)."""
    with backends("a", "b") as (a, b):
        port = free_port()
        text = TOPOLOGY.format(admin=free_port(), port=port, a=a.port, b=b.port)
        with running_envoy(text, tmp_path / "envoy"):
            assert wait_until(lambda: _send(port, "application/json", BIG) == "a", timeout=15)
            through_envoy = [_send(port, ct, body) for ct, body, _ in CASES]
        with running_nginx(text, tmp_path / "nginx") as nginx:
            nginx_port = int(nginx.url.rsplit(":", 1)[1])
            through_nginx = [_send(nginx_port, ct, body) for ct, body, _ in CASES]
    expected = [where for _, _, where in CASES]
    table = list(zip(CASES, through_envoy, through_nginx, strict=True))
    assert through_envoy == through_nginx, [row for row in table if row[1] != row[2]]
    assert through_envoy == expected, [row for row in table if row[1] != row[0][2]]
