"""The sidecar's command line (sidecar.config.from_argv and main's exit codes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from confgen import parse_topology
from sidecar import main as main_mod
from sidecar.config import ConfigError, SidecarConfig, from_argv, listen_for, listen_mismatch
from sidecar.decide.hysteresis import HysteresisPolicy
from sidecar.decide.state import HealthPolicy
from sidecar.decide.weights import WeightPolicy

TOPO = ["--topology", "topo.yaml"]


def test_defaults() -> None:
    """Only --topology given: every documented default, the probe deadline 0.75 x interval,
    the health policy's interval the cycle's, one ingress."""
    config = from_argv(TOPO)
    assert config.topology == Path("topo.yaml")
    assert config.xds_dir is None and config.envoy_admin is None
    assert (config.interval_s, config.jitter, config.max_concurrency) == (2.0, 0.1, 64)
    assert config.probe_deadline_s == pytest.approx(1.5)
    assert config.body_cap_bytes == 1024 * 1024
    assert (config.listen_host, config.listen_port) == ("127.0.0.1", 9109)
    assert config.listen_from_topology  # no --listen: the topology's sidecar link decides
    assert config.health == HealthPolicy(probe_interval_s=2.0)
    assert config.weights == WeightPolicy()
    assert (config.publish_debounce_s, config.confirm_timeout_s, config.watch_debounce_s) == (0.1, 2.0, 0.2)
    assert config.ingresses == 1
    assert (config.log_format, config.log_level) == ("json", "INFO")


def test_overrides() -> None:
    """Every flag reaches its field; KEY=VALUE policy overrides take the field's type; an
    IPv6 listen address loses its brackets; a trailing slash leaves the admin URL."""
    config = from_argv([
        *TOPO, "--xds-dir", "/x", "--envoy-admin", "http://127.0.0.1:9901/", "--interval", "0.5",
        "--jitter", "0", "--max-concurrency", "8", "--probe-deadline", "0.3", "--body-cap", "4096",
        "--listen", "[::1]:9200", "--health", "fall=5", "--health", "slow_start_s=0",
        "--weights", "smoothing=1.0", "--weights", "max_weight=50", "--hysteresis", "sustain=3",
        "--hysteresis", "threshold=0", "--publish-debounce", "0",
        "--confirm-timeout", "0.5", "--watch-debounce", "0.05", "--ingresses", "3",
        "--log-format", "text", "--log-level", "DEBUG",
    ])
    assert config.xds_dir == Path("/x") and config.envoy_admin == "http://127.0.0.1:9901"
    assert (config.interval_s, config.jitter, config.max_concurrency, config.probe_deadline_s) == (0.5, 0, 8, 0.3)
    assert config.body_cap_bytes == 4096
    assert (config.listen_host, config.listen_port) == ("::1", 9200)
    assert config.health == HealthPolicy(probe_interval_s=0.5, fall=5, slow_start_s=0.0)
    assert config.weights == WeightPolicy(smoothing=1.0, max_weight=50)
    assert config.hysteresis == HysteresisPolicy(sustain=3, threshold=0.0)
    assert (config.publish_debounce_s, config.confirm_timeout_s, config.watch_debounce_s) == (0, 0.5, 0.05)
    assert config.ingresses == 3
    assert (config.log_format, config.log_level) == ("text", "DEBUG")


@pytest.mark.parametrize(("args", "message"), [
    (["--listen", "9109"], "--listen must be host:port"),
    (["--listen", "127.0.0.1:http"], "--listen must be host:port"),
    (["--listen", "127.0.0.1:\u00b2"], "--listen must be host:port"),  # int("²") raised: ASCII digits only
    (["--listen", "127.0.0.1:70000"], "listen port 70000 out of range"),
    (["--health", "bogus=1"], "--health 'bogus=1': expected KEY=VALUE"),
    (["--health", "fall"], "expected KEY=VALUE"),
    (["--health", "fall=three"], "--health fall: 'three' is not a int"),
    (["--health", "rise=0"], "--health: probe counts must be >= 1"),
    (["--weights", "smoothing=0"], "--weights: kv_knee and smoothing"),
    (["--weights", "max_weight=100000"], "--weights: max_weight within"),
    (["--hysteresis", "sustain=0"], "--hysteresis: threshold and min_step must be >= 0, sustain >= 1"),
    (["--jitter", "1"], "jitter must be within"),
    (["--max-concurrency", "0"], "max concurrency must be >= 1"),
    (["--body-cap", "10"], "body cap >= 1024"),
    (["--health", "probe_interval_s=nan"], "--health probe_interval_s: 'nan' is not a finite number"),
    (["--saturation", "inflight_interval_s=inf"], "is not a finite number"),
    (["--ingresses", "0"], "ingresses must be >= 1"),
    # a peer's placements steer routing: never plaintext beyond loopback, never a malformed target
    (["--picker-peer", "10.0.0.2:9110"], "--picker-peer 10.0.0.2:9110: a peer over TCP needs --grpc-tls-cert"),
    (["--picker-peer", "127.0.0.1:9110"], "a peer over TCP needs"),  # loopback too, unless plaintext is chosen
    (["--picker-peer", "unix:"], "--picker-peer unix:: give unix:PATH"),
    (["--picker-peer", "peer"], "--picker-peer peer: expected unix:PATH or HOST:PORT"),
    (["--picker-peer", "peer:99999"], "expected unix:PATH or HOST:PORT"),
    (["--picker-peer", "peer:\u00b2"], "expected unix:PATH or HOST:PORT"),  # int("²") raised: ASCII digits only
    # peers found by DNS are other hosts: mutual TLS only, whatever the name
    (["--picker-peer", "dns:pickers:9110"], "--picker-peer dns:pickers:9110: peers found by DNS"),
    (["--grpc-plaintext-loopback", "--picker-peer", "dns:localhost:9110"], "give --grpc-tls-cert"),
    (["--picker-peer", "dns:pickers"], "--picker-peer dns:pickers: expected dns:HOST:PORT"),
    (["--picker-peer", "dns::9110"], "expected dns:HOST:PORT"),
    (["--picker-peer", "dns:pickers:0"], "expected dns:HOST:PORT"),
])
def test_impossible_values_are_config_errors(args: list[str], message: str) -> None:
    """A value of the right type but an impossible meaning raises ConfigError naming it."""
    with pytest.raises(ConfigError) as info:
        from_argv([*TOPO, *args])
    assert message in str(info.value)


def test_picker_peers_over_a_unix_socket_or_loopback_plaintext_when_chosen() -> None:
    config = from_argv([*TOPO, "--picker-peer", "unix:/run/b/grpc.sock", "--picker-peer", "unix:/run/c/grpc.sock"])
    assert config.picker_peers == ("unix:/run/b/grpc.sock", "unix:/run/c/grpc.sock")
    config = from_argv([*TOPO, "--grpc-plaintext-loopback", "--picker-peer", "127.0.0.1:9111"])
    assert config.picker_peers == ("127.0.0.1:9111",)


@pytest.mark.parametrize("args", [
    [],  # --topology is required
    [*TOPO, "--interval", "fast"],
    # found by review: -1 and inf were tracebacks, nan probed once and never again, 1e-6 spun a core
    *([*TOPO, flag, value] for flag in ("--interval", "--probe-deadline", "--publish-debounce", "--confirm-timeout",
                                        "--watch-debounce")
      for value in ("nan", "inf", "1e400", "-1")),
    [*TOPO, "--interval", "0"],
    [*TOPO, "--interval", "0.000001"],
    [*TOPO, "--ingresses", "1.5"],
    [*TOPO, "--log-format", "xml"],
    [*TOPO, "--no-such-flag"],
])
def test_usage_errors_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """What argparse refuses (missing, unparsable, unknown) exits 2 with a usage message."""
    with pytest.raises(SystemExit) as info:
        from_argv(args)
    assert info.value.code == 2
    assert "usage: confgen-sidecar" in capsys.readouterr().err


def test_main_reports_config_errors_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """main() turns a ConfigError into exit code 2 and one line on stderr, before any I/O."""
    assert main_mod.main([*TOPO, "--jitter", "2"]) == main_mod.EXIT_USAGE == 2
    assert capsys.readouterr().err.strip() == "confgen-sidecar: jitter must be within [0, 1)"


def test_config_built_in_code_is_checked_too() -> None:
    """SidecarConfig checks its own fields, so a config built without argv is no looser."""
    with pytest.raises(ConfigError, match="ingresses"):
        SidecarConfig(topology=Path("t.yaml"), ingresses=0)
    with pytest.raises(ConfigError, match="listen port"):
        SidecarConfig(topology=Path("t.yaml"), listen_port=-1)


_LINKED = """\
version: 1
name: t
listeners: [{name: public, port: 8080}]
pools: [{name: chat, engine: llamacpp, models: [m], workers: ["127.0.0.1:8000"]}]
"""


def test_without_listen_the_sidecar_listens_where_the_topology_says() -> None:
    """One source: with no --listen the sidecar takes the topology's sidecar.address:port,
    the address the rendered proxy asks for /v1/models (before, it always took
    127.0.0.1:9109, whatever the topology said)."""
    topo, _ = parse_topology((_LINKED + "sidecar: {address: 127.0.0.2, port: 9311}\n").encode())
    config = listen_for(from_argv(TOPO), topo)
    assert (config.listen_host, config.listen_port) == ("127.0.0.2", 9311)
    assert listen_mismatch(config, topo) is None
    given = listen_for(from_argv([*TOPO, "--listen", "127.0.0.1:9400"]), topo)
    assert (given.listen_host, given.listen_port) == ("127.0.0.1", 9400)  # --listen wins


@pytest.mark.parametrize(
    ("listen", "tail", "problem"),
    [
        ("127.0.0.1:9400", "", "--listen port 9400 is not the topology's sidecar.port 9109"),
        ("127.0.0.1:9109", "sidecar: {port: 9200}\n", "--listen port 9109 is not the topology's sidecar.port 9200"),
        ("10.0.0.7:9109", "", "--listen host 10.0.0.7 is not the topology's sidecar.address 127.0.0.1"),
        ("0.0.0.0:9109", "", None),  # every address, the topology's among them
        ("127.0.0.1:9109", "", None),
        ("127.0.0.1:9400", "sidecar: {models: false}\n", None),  # the proxy never asks the sidecar
        ("127.0.0.1:9400", "models_endpoint: false\n", None),
    ],
)
def test_a_listen_the_proxy_cannot_reach_is_named(listen: str, tail: str, problem: str | None) -> None:
    """--listen elsewhere than the topology's sidecar link is a problem the sidecar reports
    (startup.listen_mismatch, an error): the proxy would ask a port nobody listens on and
    silently answer the full model list. Wildcard hosts cover the topology's address."""
    topo, _ = parse_topology((_LINKED + tail).encode())
    found = listen_mismatch(listen_for(from_argv([*TOPO, "--listen", listen]), topo), topo)
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.startswith(problem), found


_ADS_TOPOLOGY = """\
version: 1
name: t
listeners: [{name: public, port: 18080}]
envoy: {xds: {mode: ads, servers: ["127.0.0.1:18001", "127.0.0.1:18002"]}}  # no config_dir, as an ADS topology
pools:
  - {name: p, engine: vllm, models: [m], workers: ["127.0.0.1:8000"]}
"""


def test_an_ads_topology_needs_the_sidecar_to_serve_ads(tmp_path: Path) -> None:
    """envoy.xds.mode ads without --serve-xds: the Envoys wait for a control plane and read no file.
    The sidecar refuses to start (exit 2, the reason logged) and refuses such a reload."""
    import subprocess
    import sys

    from confgen.runtime import free_port
    from sidecar.config import publisher_mismatch
    from sidecar.daemon import _load

    topo, _ = parse_topology(_ADS_TOPOLOGY.encode(), "t.yaml")
    problem = publisher_mismatch(from_argv(["--topology", "t.yaml"]), topo)
    assert problem is not None and "--serve-xds" in problem and "127.0.0.1:18001, 127.0.0.1:18002" in problem
    assert publisher_mismatch(from_argv(["--topology", "t.yaml", "--serve-xds", "unix"]), topo) is None
    files, _ = parse_topology(_ADS_TOPOLOGY.replace("mode: ads, ", "").encode(), "t.yaml")
    assert publisher_mismatch(from_argv(["--topology", "t.yaml"]), files) is None
    path = tmp_path / "topology.yaml"
    path.write_text(_ADS_TOPOLOGY)
    with pytest.raises(ConfigError, match="--serve-xds"):
        _load(from_argv(["--topology", str(path)]), path)
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.main", "--topology", str(path), "--listen", f"127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=60, check=False, cwd=root)
    assert result.returncode == 2, result
    assert "startup.publisher_mismatch" in result.stderr + result.stdout
