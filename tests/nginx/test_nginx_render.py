"""The nginx target as files: every example accepted by the real `nginx -t`, the guard
against injection, the upstream include files, and the warnings for what nginx cannot do."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from confgen import SecretError, TopologyError, nginx, parse_topology
from confgen.cli import main
from confgen.envoy._replies import local_reply_config
from confgen.nginx import UnsafeValueError, UpstreamServer, render_upstream
from confgen.nginx._guard import bare, quoted
from confgen.topology import load
from confgen.verify import loopback_ports

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))

MINIMAL = """
version: 1
name: t
listeners: [{name: public, port: 8080}]
pools:
  - name: p
    engine: vllm
    models: [m]
    workers: [127.0.0.1:8000]
"""


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_passes_real_nginx_t(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`confgen validate --nginx` renders the example and the real nginx -t accepts it (exit 0)."""
    assert main(["validate", "--nginx", str(example)]) == 0
    out = capsys.readouterr()
    assert f"{example}: ok" in out.out
    assert "[emerg]" not in out.out + out.err


def test_examples_exist() -> None:
    """The example folder is found (the parametrized test above would pass vacuously otherwise)."""
    assert len(EXAMPLES) >= 5


def test_validate_nginx_warns_with_file_line_col(capsys: pytest.CaptureFixture[str]) -> None:
    """Bounded-load hashing and maglev, which nginx cannot honour, are warnings pinned to their line."""
    example = next(p for p in EXAMPLES if "affinity" in p.name)
    assert main(["validate", "--nginx", str(example)]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"{re.escape(str(example))}:20:\d+: pools\[0\]\.balancing\.hash_balance_factor: warning: ", out)
    assert re.search(r":31:\d+: pools\[1\]\.balancing\.policy: warning: maglev", out)
    assert main(["validate", "--nginx", "--strict", str(example)]) == 1


def test_validate_without_nginx_flag_has_no_nginx_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    """The nginx warnings belong to --nginx only; a plain validate stays quiet about nginx."""
    example = next(p for p in EXAMPLES if "affinity" in p.name)
    assert main(["validate", str(example)]) == 0
    assert "NGINX Plus" not in capsys.readouterr().out


def test_unsupported_lists_envoy_only_features() -> None:
    """unsupported() names active health checks, bounded load, maglev, drain and a non-loopback status."""
    topo, _ = parse_topology((MINIMAL.replace("workers: [127.0.0.1:8000]", """workers:
      - {address: 127.0.0.1:8000, drain: true}
    balancing: {policy: maglev, hash_on: {header: x-session-id}}
admin: {address: 10.0.0.1}""")).encode())
    paths = {path for path, _ in nginx.unsupported(topo)}
    assert {"pools[0].health", "pools[0].balancing.hash_balance_factor", "pools[0].balancing.policy",
            "pools[0].workers[0].drain", "admin.address"} <= paths
    conf = nginx.render(topo, config_dir="/etc/x", secrets=None)
    assert "hash $http_x_session_id consistent;" in conf["nginx.conf"].decode()
    assert "listen 127.0.0.1:9901;" in conf["nginx.conf"].decode()
    assert " down;" in conf["upstreams/p.conf"].decode()


BAD_VALUES = ["a\nb", "a;b", "a{b", "a}b", "a#b", "a$b", 'a"b', "a'b", "a\x00b", "a\\b"]
FIELDS = [
    ("pool name", "- name: p\n", "- name: {v}\n"),
    ("model", "models: [m]", "models: [{v}]"),
    ("listener name", "name: public", "name: {v}"),
    ("topology name", "name: t\n", "name: {v}\n"),
]


@pytest.mark.parametrize("bad", BAD_VALUES, ids=repr)
@pytest.mark.parametrize(("what", "old", "new"), FIELDS, ids=[f[0] for f in FIELDS])
def test_loader_refuses_injection(bad: str, what: str, old: str, new: str) -> None:
    """A value carrying nginx structure (newline ; { } # $ quotes NUL backslash) is refused on load."""
    text = MINIMAL.replace(old, new.format(v=json.dumps(bad)), 1)
    assert json.dumps(bad) in text, what
    with pytest.raises(TopologyError):
        parse_topology(text.encode())


@pytest.mark.parametrize("bad", BAD_VALUES, ids=repr)
def test_cli_refuses_injection_with_exit_1(bad: str, tmp_path: Path) -> None:
    """`confgen render --target nginx` exits 1 on such a topology and writes nothing."""
    text = MINIMAL + f"last_resort: {{kind: error, message: {json.dumps('busy ' + bad)}}}\n"
    source = tmp_path / "t.yaml"
    source.write_text(text)
    assert main(["render", "--target", "nginx", str(source), "-o", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", BAD_VALUES, ids=repr)
def test_template_guard_raises_on_unvalidated_values(bad: str) -> None:
    """Values that skip the loader (a hand-built model) still never reach the file: render raises.
    Model names reach only the njs module, as ASCII JSON string literals (inert there)."""
    topo, _ = parse_topology(MINIMAL.encode())
    inert_in_quotes = bad in ('a"b', "a;b", "a{b", "a}b", "a#b")
    pool = dataclasses.replace(topo.pools[0], models=[f"m{bad}"])
    files = nginx.render(dataclasses.replace(topo, pools=[pool]), config_dir="/etc/x", secrets=None)
    assert f"m{bad}".encode() not in files["nginx.conf"]
    assert json.dumps(f"m{bad}", ensure_ascii=True).encode() in files["njs/confgen.js"]
    named = dataclasses.replace(topo.pools[0], name=f"p{bad}")
    with pytest.raises(UnsafeValueError):
        nginx.render(dataclasses.replace(topo, pools=[named]), config_dir="/etc/x", secrets=None)
    with pytest.raises(UnsafeValueError):
        bare(f"x{bad}")
    if not inert_in_quotes:
        with pytest.raises(UnsafeValueError):
            quoted(f"x{bad}")
    with pytest.raises(UnsafeValueError):
        render_upstream("p", [UpstreamServer(f"10.0.0.1{bad}", 80)])
    with pytest.raises(UnsafeValueError):
        nginx.render(topo, config_dir=f"/etc/x{bad}", secrets=None)


def test_api_keys_must_be_bearer_tokens() -> None:
    """A key that is not a Bearer token (here with a quote and a `;`) is refused for nginx."""
    topo, _ = parse_topology((MINIMAL + "auth: {api_keys: [{client: a, env: K}]}\n").encode())
    with pytest.raises(SecretError):
        nginx.render(topo, config_dir="/etc/x", secrets={"a": 'k";x'})
    files = nginx.render(topo, config_dir="/etc/x", secrets={"a": "sk-abc_DEF.123+/=="})
    assert files["auth/clients.map"] == b'"~^[Bb][Ee][Aa][Rr][Ee][Rr] +sk-abc_DEF[.]123[+]/==$" a;\n'
    assert b"sk-abc" not in files["nginx.conf"]


def test_render_upstream_lines() -> None:
    """One server line per worker with weight, passive-check values and flags; a placeholder when empty."""
    text = render_upstream("p", [
        UpstreamServer("10.0.0.2", 8000, weight=3),
        UpstreamServer("fd00::1", 8000, down=True),
        UpstreamServer("10.0.0.1", 8000, backup=True),
    ], max_fails=2, fail_timeout="15s").decode()
    lines = [line for line in text.splitlines() if line.startswith("server")]
    assert lines == [
        "server 10.0.0.2:8000 weight=3 max_fails=2 fail_timeout=15s;",
        "server [fd00::1]:8000 weight=1 max_fails=2 fail_timeout=15s down;",
        "server 10.0.0.1:8000 weight=1 max_fails=2 fail_timeout=15s backup;",
    ]
    assert "server 127.0.0.1:1 down;" in render_upstream("p", []).decode()
    with pytest.raises(ValueError, match="backup"):
        render_upstream("p", [UpstreamServer("10.0.0.1", 80, backup=True)], hashing=True)
    with pytest.raises(ValueError, match="weight"):
        UpstreamServer("10.0.0.1", 80, weight=0)


def test_each_pool_has_its_own_include_file() -> None:
    """nginx.conf includes upstreams/<pool>.conf per pool (the sidecar's unit of replacement)."""
    topo, _ = load(next(p for p in EXAMPLES if "multi-model" in p.name))
    files = nginx.render(topo, config_dir="/etc/confgen/nginx", secrets=None)
    conf = files["nginx.conf"].decode()
    for pool in topo.pools:
        assert f"upstreams/{pool.name}.conf" in files
        assert f"include /etc/confgen/nginx/upstreams/{pool.name}.conf;" in conf
    assert not re.search(r"^\s*server (?!{)", conf, re.MULTILINE)  # no server line outside the include files


def test_eds_pool_with_dns_names_starts_with_placeholder() -> None:
    """DNS-named workers of an eds pool wait for the sidecar (like Envoy's EDS): a down placeholder."""
    topo, _ = load(next(p for p in EXAMPLES if "dns" in p.name))
    files = nginx.render(topo, config_dir="/etc/x", secrets=None)
    assert "server 127.0.0.1:1 down;" in files["upstreams/llama-70b.conf"].decode()
    assert "vllm-batch.inference.svc.cluster.local:8000" in files["upstreams/llama-8b-dns.conf"].decode()


def test_render_for_test_stays_inside_prefix(tmp_path: Path) -> None:
    """The test copy listens only on 127.0.0.1 and names no absolute path outside the prefix."""
    for example in EXAMPLES:
        topo, _ = load(example)
        files = nginx.render_for_test(topo, prefix=str(tmp_path), ports=loopback_ports(topo))
        conf = files["nginx.conf"].decode()
        listens = re.findall(r"^\s*listen (\S+);", conf, re.MULTILINE)
        assert listens and all(addr.startswith("127.0.0.1:") for addr in listens), example
        paths = re.findall(r"(?<![\w'\"/:])(/[\w./-]+)", conf)
        outside = {p for p in paths if not p.startswith(str(tmp_path)) and p not in ("/", "/status", "/v1/models")}
        assert not outside, (example, outside)
        assert f"pid {tmp_path}/nginx.pid;" in conf


def test_429_and_404_bodies_match_the_envoy_target() -> None:
    """The rate-limit JSON nginx answers is the Envoy target's, word for word."""
    topo, _ = parse_topology(MINIMAL.encode())
    mappers = local_reply_config(topo, shedding=False)["mappers"]
    overload = next(m for m in mappers if m["filter"] == {"response_flag_filter": {"flags": ["UO"]}})
    envoy_429 = overload["body_format_override"]["json_format"]
    conf = nginx.render(topo, config_dir="/etc/x", secrets=None)["nginx.conf"].decode()
    assert json.dumps(envoy_429, sort_keys=True, separators=(",", ":")) in conf
    js = nginx.render(topo, config_dir="/etc/x", secrets=None)["njs/confgen.js"].decode()
    assert "does not exist or is not served here." in js


def test_hashing_on_the_client_id_header_hashes_on_the_authenticated_id() -> None:
    """Found by review: a pool hashing on `auth.client_header` hashed on the client's own copy of it
    ($http_x_confgen_client), so a caller chose its worker, or piled onto one. It hashes on the id the key
    proved ($confgen_client), as Envoy does; another header stays the client's (a session id)."""
    text = MINIMAL.replace("    workers: [127.0.0.1:8000]\n", "    workers: [127.0.0.1:8000, 127.0.0.1:8001]\n"
                           "    balancing: {policy: ring_hash, hash_on: {header: x-confgen-client}}\n")
    keyed = text + "auth: {api_keys: [{client: a, env: K}]}\n"
    topo, _ = parse_topology(keyed.encode())
    conf = nginx.render(topo, config_dir="/etc/x", secrets={"a": "sk-abcdefghijklmnop"})["nginx.conf"].decode()
    assert "hash $confgen_client consistent;" in conf and "$http_x_confgen_client" not in conf
    session = text.replace("x-confgen-client", "x-session-id") + "auth: {api_keys: [{client: a, env: K}]}\n"
    topo, _ = parse_topology(session.encode())
    conf = nginx.render(topo, config_dir="/etc/x", secrets={"a": "sk-abcdefghijklmnop"})["nginx.conf"].decode()
    assert "hash $http_x_session_id consistent;" in conf
