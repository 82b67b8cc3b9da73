"""When the real proxy refuses a render, the refusal is said in the topology's terms: the
field that led there and one short line, never the proxy's protobuf dump.

The refusals are provoked by editing a correct render the way a renderer bug would (validate
refuses every such value in a topology), then fed to the real Envoy and nginx."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from confgen import envoy, nginx, runtime
from confgen._rejection import explain_envoy, explain_nginx
from confgen.topology import load, pin

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "04-multi-model-fallback.yaml"


def _bootstrap() -> tuple[Any, dict[str, Any]]:
    topo, _ = load(EXAMPLE)
    files = envoy.render(topo, config_dir="/nonexistent", secrets=None)  # placeholder keys
    return topo, envoy.static_bootstrap(files)


def test_envoy_refusal_of_a_pool_setting_names_the_pool_field() -> None:
    """A health-check value Envoy refuses comes back as pools[i].health.<field>, pinned to its line,
    with Envoy's reason in one line."""
    topo, boot = _bootstrap()
    broken = copy.deepcopy(boot)
    cluster = broken["static_resources"]["clusters"][1]
    cluster["health_checks"][0]["no_traffic_interval"] = "0s"
    (record,) = runtime.validate_envoy_static(broken)
    assert "node {" in record or "Proto constraint" in record  # what the user used to see
    path, message = explain_envoy(record, broken, topo)
    pool = [p.name for p in topo.pools].index(cluster["name"])
    assert path == f"pools[{pool}].health.no_traffic_interval"
    assert message == ("Envoy refused static_resources.clusters[1].health_checks[0].no_traffic_interval: "
                       "value must be greater than 0s")
    (diag,) = pin(EXAMPLE, [(path, message)], "error")
    assert diag.line > 1 and diag.path.startswith(f"pools[{pool}]")


def test_envoy_refusal_without_a_field_chain_is_one_short_line() -> None:
    """A refusal that is not a field constraint (a route to an unknown cluster) is shortened to its
    first meaningful line, without the bootstrap dump."""
    topo, boot = _bootstrap()
    broken = copy.deepcopy(boot)
    broken["static_resources"]["clusters"] = broken["static_resources"]["clusters"][:1]
    records = runtime.validate_envoy_static(broken)
    assert records
    path, message = explain_envoy(records[0], broken, topo)
    assert path == ""
    assert message.startswith("Envoy refused it: ")
    assert "\n" not in message and "node {" not in message and len(message) <= 320


def test_nginx_refusal_in_an_upstream_file_names_the_pool(tmp_path: Path) -> None:
    """nginx -t refusing a pool's upstream file is reported against that pool, with the file and line."""
    topo, _ = load(EXAMPLE)
    files = nginx.render_for_test(topo, prefix=str(tmp_path))
    pool = topo.pools[0].name
    rel = f"upstreams/{pool}.conf"
    files[rel] = files[rel].replace(b"server ", b"server_bogus ", 1)
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    (line,) = runtime.nginx_test((tmp_path / "nginx.conf").read_text(), tmp_path)
    path, message = explain_nginx(line, files, str(tmp_path), topo)
    assert path == "pools[0]"
    assert message.startswith(f"nginx refused {rel}:")
    assert str(tmp_path) not in message


def test_a_tls_file_envoy_cannot_read_is_named_by_its_field(tmp_path: Path) -> None:
    """`validate --envoy` on a machine without the gRPC TLS files (they live where Envoy runs): the real
    Envoy's "Invalid path" comes back at the field naming the file, not at the file's top."""
    from confgen import verify

    text = (EXAMPLE.read_text() + "\nsidecar:\n  grpc_tls: {cert: /run/confgen-none/tls.crt, key: "
            "/run/confgen-none/tls.key, ca: /run/confgen-none/ca.crt}\n")
    source = tmp_path / "topology.yaml"
    source.write_text(text)
    topo, _ = load(source)
    refused = verify.verify(topo, "envoy")
    assert refused and refused[0].field.startswith("sidecar.grpc_tls."), refused
    assert "Invalid path: /run/confgen-none/" in refused[0].message
