"""POST /drain and /undrain are safe by default (sidecar.serve.guard), checked with real HTTP
requests against the sidecar's real aiohttp app on loopback:

- any request with an Origin header is refused (403), and any body that is not JSON
  (form, text/plain: what a cross-site "simple request" can send) is refused (415);
- bound beyond loopback without a token the mutating endpoints are off (403); with a
  token, a request without it or with another one gets 401, with it 200;
- /metrics, /healthz and /readyz stay open whatever the guard.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.registry import CollectorRegistry

from confgen.runtime import free_port
from confgen.topology import load as load_topology
from sidecar.config import ConfigError, SidecarConfig
from sidecar.daemon import Daemon
from sidecar.observe.probe import Prober
from sidecar.observe.resolve import Resolver
from sidecar.outputs.envoy_admin import EnvoyAdmin
from sidecar.outputs.files.publisher import EdsPublisher
from sidecar.serve.guard import MutationGuard, is_loopback, load_token
from sidecar.serve.server import build_app

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "t0ken-for-the-drain-endpoints"
TOPOLOGY = """\
version: 1
name: guard
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
pools:
  - name: chat
    engine: vllm
    models: [m]
    workers: ["127.0.0.1:{worker}"]
"""

Call = Callable[..., Awaitable[tuple[int, dict[str, str]]]]


async def _serve(tmp: Path, guard: MutationGuard,
                 scenario: Callable[[Call, str, str], Awaitable[None]], topology: str = TOPOLOGY) -> None:
    """The sidecar's app (real Daemon) on 127.0.0.1 with `guard`; `scenario(call, base, worker)`."""
    worker = f"127.0.0.1:{free_port()}"
    path = tmp / "topology.yaml"
    path.write_text(topology.format(admin=free_port(), port=free_port(), worker=worker.split(":")[1]))
    topo, _ = load_topology(path)
    config = SidecarConfig(topology=path, xds_dir=tmp / "envoy", confirm_timeout_s=0.0)
    loop = asyncio.get_running_loop()
    async with (
        Prober(max_concurrency=2, deadline_s=0.5, body_cap=1 << 20, clock=loop.time) as prober,
        EnvoyAdmin(f"http://127.0.0.1:{free_port()}", timeout_s=0.2) as admin,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
    ):
        publisher = EdsPublisher(tmp / "envoy", admin, debounce_s=0.0, confirm_timeout_s=0.0)
        daemon = Daemon(config, topo, prober=prober, resolver=Resolver(1.0), publisher=publisher, clock=loop.time)
        runner = web.AppRunner(build_app(daemon, CollectorRegistry(), guard=guard), access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        base = f"http://127.0.0.1:{port}"

        async def call(method: str, path: str, *, data: bytes | None = None,
                       headers: dict[str, str] | None = None) -> tuple[int, dict[str, str]]:
            async with session.request(method, base + path, data=data, headers=headers or {}) as resp:
                body = await resp.json(content_type=None) if resp.status != 200 or path != "/metrics" else {}
                return resp.status, body if isinstance(body, dict) else {}

        try:
            await scenario(call, base, worker)
        finally:
            await publisher.close()
            await runner.cleanup()


def _json(pool: str, worker: str) -> bytes:
    return f'{{"pool": "{pool}", "worker": "{worker}"}}'.encode()


JSON = {"Content-Type": "application/json"}


def test_with_the_token_it_still_refuses_cross_site_and_non_json(tmp_path: Path) -> None:
    """On loopback with the token: Origin -> 403, form / text/plain / no type -> 415, a
    JSON array -> 400, an unknown worker -> 404; a JSON drain and undrain -> 200."""

    async def scenario(call: Call, base: str, worker: str) -> None:
        body = _json("chat", worker)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        json_auth = {**JSON, **auth}
        assert (await call("POST", "/drain", data=body,
                           headers={**json_auth, "Origin": "https://evil.example"}))[0] == 403
        assert (await call("POST", "/drain", data=body, headers={**json_auth, "Origin": "null"}))[0] == 403
        form = {"Content-Type": "application/x-www-form-urlencoded", **auth}
        assert (await call("POST", f"/drain?pool=chat&worker={worker}", data=b"a=b", headers=form))[0] == 415
        assert (await call("POST", "/drain", data=body, headers={"Content-Type": "text/plain", **auth}))[0] == 415
        assert (await call("POST", f"/drain?pool=chat&worker={worker}", headers=auth))[0] == 415
        assert (await call("POST", "/drain", data=b"[1]", headers=json_auth))[0] == 400
        assert (await call("POST", "/drain", data=b"{nope", headers=json_auth))[0] == 400
        assert (await call("POST", "/drain", data=_json("chat", "127.0.0.1:1"), headers=json_auth))[0] == 404
        status, answer = await call("POST", "/drain", data=body, headers=json_auth)
        assert (status, answer.get("drained")) == (200, True)
        status, answer = await call("POST", f"/undrain?pool=chat&worker={worker}", headers=json_auth)
        assert (status, answer.get("drained")) == (200, False)

    asyncio.run(_serve(tmp_path, MutationGuard(token=TOKEN, remote=False), scenario))


def test_an_undrain_of_a_drain_the_topology_declares_says_it_stays_drained(tmp_path: Path) -> None:
    """Found by review: an undrain of a worker the topology drains (`drain: true`) answered 200 "drained": false
    while the worker stayed DRAINING. It answers 409 naming the topology; a drain of it is fine."""

    async def scenario(call: Call, base: str, worker: str) -> None:
        auth = {**JSON, "Authorization": f"Bearer {TOKEN}"}
        status, answer = await call("POST", "/undrain", data=_json("chat", worker), headers=auth)
        assert status == 409 and "drain: true" in answer["error"], answer
        assert (await call("POST", "/drain", data=_json("chat", worker), headers=auth))[0] == 200

    drained = TOPOLOGY.replace('workers: ["127.0.0.1:{worker}"]', 'workers: [{{address: "127.0.0.1:{worker}", '
                               'drain: true}}]')
    asyncio.run(_serve(tmp_path, MutationGuard(token=TOKEN, remote=False), scenario, drained))


@pytest.mark.parametrize("remote", [True, False])
def test_without_a_token_mutations_are_off_and_scraping_open(tmp_path: Path, remote: bool) -> None:
    """No token, beyond loopback or on it (every local user reaches a loopback port): every POST is 403
    naming the flags; GETs answer."""

    async def scenario(call: Call, base: str, worker: str) -> None:
        status, answer = await call("POST", "/drain", data=_json("chat", worker), headers=JSON)
        assert status == 403 and "--admin-token-file" in str(answer.get("error"))
        assert ("loopback, which every local user reaches" in str(answer.get("error"))) is not remote
        assert (await call("GET", "/metrics"))[0] == 200
        assert (await call("GET", "/healthz"))[0] == 200
        assert (await call("GET", "/readyz"))[0] in (200, 503)  # answers; no cycle ran here

    asyncio.run(_serve(tmp_path, MutationGuard(token=None, remote=remote), scenario))


@pytest.mark.parametrize("remote", [True, False])
def test_a_token_is_required_when_configured(tmp_path: Path, remote: bool) -> None:
    """With a token (remote or not): none, a wrong one or another scheme -> 401; the right
    one -> 200; the right one with an Origin -> still 403."""

    async def scenario(call: Call, base: str, worker: str) -> None:
        body = _json("chat", worker)
        assert (await call("POST", "/drain", data=body, headers=JSON))[0] == 401
        wrong = {**JSON, "Authorization": f"Bearer {TOKEN}x"}
        assert (await call("POST", "/drain", data=body, headers=wrong))[0] == 401
        basic = {**JSON, "Authorization": f"Basic {TOKEN}"}
        assert (await call("POST", "/drain", data=body, headers=basic))[0] == 401
        right = {**JSON, "Authorization": f"Bearer {TOKEN}"}
        assert (await call("POST", "/drain", data=body, headers={**right, "Origin": "https://a.example"}))[0] == 403
        assert (await call("POST", "/drain", data=body, headers=right))[0] == 200
        assert (await call("GET", "/metrics"))[0] == 200

    asyncio.run(_serve(tmp_path, MutationGuard(token=TOKEN, remote=remote), scenario))


def test_loopback_addresses() -> None:
    """Loopback: 127.0.0.0/8, ::1, localhost. Anything else (0.0.0.0, ::, "", a name) is not."""
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "10.0.0.1", "sidecar.example"))


def test_token_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token file or env var gives the token; short, malformed, device or both -> ConfigError."""
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert load_token(path, None) == TOKEN
    monkeypatch.setenv("CONFGEN_GUARD_TOKEN", TOKEN)
    assert load_token(None, "CONFGEN_GUARD_TOKEN") == TOKEN
    assert load_token(None, None) is None
    for bad in ("short", "has space in it here", "a" * 513):
        path.write_text(bad)
        with pytest.raises(ConfigError, match="16-512"):
            load_token(path, None)
    with pytest.raises(ConfigError, match="character device"):
        load_token(Path("/dev/zero"), None)
    with pytest.raises(ConfigError, match="not both"):
        load_token(path, "CONFGEN_GUARD_TOKEN")
    monkeypatch.delenv("CONFGEN_GUARD_TOKEN")
    with pytest.raises(ConfigError, match="not set"):
        load_token(None, "CONFGEN_GUARD_TOKEN")


def test_sidecar_refuses_to_start_with_an_unusable_token(tmp_path: Path) -> None:
    """`confgen-sidecar --admin-token-env UNSET` exits 2 with a log line naming the flag."""
    path = tmp_path / "topology.yaml"
    path.write_text(TOPOLOGY.format(admin=free_port(), port=free_port(), worker=free_port()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFGEN_")}
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.main", "--topology", str(path), "--xds-dir", str(tmp_path / "envoy"),
         "--listen", f"127.0.0.1:{free_port()}", "--admin-token-env", "CONFGEN_GUARD_UNSET"],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2, result
    assert "--admin-token-env CONFGEN_GUARD_UNSET" in result.stderr


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_rendered_manifests_expose_no_mutating_endpoint_without_a_token() -> None:
    """For every example: the Kubernetes sidecar's args parse with the sidecar's own parser,
    and it binds beyond loopback (probes and Prometheus need the pod's addresses) only with
    no token flag, i.e. with mutations off (test above), or with a token; the Compose
    sidecar binds loopback; the Compose render step has no network."""
    import yaml

    from confgen.deploy import render_compose, render_kubernetes
    from sidecar.config import from_argv

    for example in sorted((ROOT / "examples").glob("*.yaml")):
        topo, _ = load_topology(example)
        sidecars = [c for doc in yaml.safe_load_all(render_kubernetes(topo)["kubernetes.yaml"])
                    if doc and doc.get("kind") == "Deployment"
                    for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == "sidecar"]
        assert sidecars, example
        for container in sidecars:
            assert container["command"] == ["confgen-sidecar"]
            config = from_argv(container["args"])
            token_flag = config.admin_token_file is not None or config.admin_token_env is not None
            mode = "token" if token_flag else "loopback" if is_loopback(config.listen_host) else "off"
            assert mode in ("token", "off", "loopback"), (example, mode)
            if mode == "off":  # what the manifests ship today: reachable for scraping, mutations off
                assert MutationGuard(token=None, remote=not is_loopback(config.listen_host)).remote
        services = yaml.safe_load(render_compose(topo)["compose.yaml"])["services"]
        assert services["sidecar"]["entrypoint"] == ["confgen-sidecar"]
        compose = from_argv(services["sidecar"]["command"])
        assert is_loopback(compose.listen_host), example
        assert services["render"]["network_mode"] == "none"


def test_a_token_file_readable_beyond_its_owner_is_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Found by review: a 0644 admin token file loaded silently. Loaded (a mount may set its mode), warned."""
    from sidecar.serve.guard import load_token

    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    with caplog.at_level("WARNING", logger="sidecar.serve.guard"):
        assert load_token(path, None) == TOKEN
    assert not [r for r in caplog.records if "token_file_open" in r.getMessage()]
    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="sidecar.serve.guard"):
        assert load_token(path, None) == TOKEN
    assert [r for r in caplog.records if "token_file_open" in r.getMessage()]
