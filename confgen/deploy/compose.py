"""Docker Compose: Envoy and the sidecar sharing the rendered xDS directory on one host.

Every service names its program (`entrypoint`, arguments in `command`), so what runs does not
depend on the image's ENTRYPOINT/CMD: sidecar/Dockerfile's ENTRYPOINT is confgen-sidecar, and
`command: [confgen, render, ...]` alone would run `confgen-sidecar confgen render ...`.
tests/deploy/test_compose_run.py resolves each service as Docker does and runs the argv.
"""

from __future__ import annotations

import shlex

from ..balancing import grpc_wanted
from ..errors import DeployError
from ..model import Topology, grpc_socket_dir, grpc_transport, is_ip, split_address
from ._canonical import dump, topology_yaml

XDS_DIR = "/var/run/confgen/envoy"


def render_compose(topo: Topology) -> dict[str, bytes]:
    k8s = topo.kubernetes
    key_env = [k.env for k in (topo.auth.api_keys if topo.auth else []) if k.env is not None]
    store = topo.limits.store if topo.limits is not None else None
    store_env = [store.password_env] if store is not None and store.password_env is not None else []
    topology_file = "/etc/confgen/topology.yaml"
    shared = ["./topology.yaml:/etc/confgen/topology.yaml:ro", "xds:" + XDS_DIR]
    # API keys held in files: render reads them, and the sidecar again when a topology change re-renders the
    # listeners. Bound read-only at the path the topology names (the file must be readable by uid 101).
    key_files = sorted({k.file for k in (topo.auth.api_keys if topo.auth else []) if k.file is not None})
    shared += [f"{path}:{path}:ro" for path in key_files]
    # Envoy calls the sidecar's gRPC services on its Unix socket: one volume at the socket directory's
    # parent in both (the sidecar makes its 0700 directory there; both images run as uid 101)
    wanted = grpc_wanted(topo)
    sockets = [f"grpc-sockets:{grpc_socket_dir(topo).rsplit('/', 1)[0] or '/'}"] \
        if wanted and grpc_transport(topo) == "unix" else []
    services = {
        "render": {
            "image": k8s.sidecar_image,
            "entrypoint": ["confgen"],
            "command": ["render", topology_file, "-o", XDS_DIR, "--config-dir", XDS_DIR],
            "volumes": shared,
            "environment": key_env,
            "network_mode": "none",  # it renders files: no network at all
        },
        "sidecar": {
            "image": k8s.sidecar_image,
            "entrypoint": ["confgen-sidecar"],
            "command": ["--topology", topology_file, "--xds-dir", XDS_DIR,
                        "--listen", f"127.0.0.1:{topo.sidecar.port}",
                        # as the topology has Envoy call the gRPC services (mutual TLS is refused: targets)
                        *(["--grpc-plaintext-loopback"] if wanted and grpc_transport(topo) == "plaintext" else [])],
            "volumes": [*shared, *sockets],
            "environment": [*key_env, *store_env],
            # host networking: it reaches the workers as Envoy does (and Envoy's admin on its socket in
            # xds/); it listens on loopback only, so nothing of it is reachable from outside
            "network_mode": "host",
            "depends_on": {"render": {"condition": "service_completed_successfully"}},
            "restart": "unless-stopped",
        },
        "envoy": {
            "image": k8s.envoy_image,
            # the envoy image's entrypoint runs `envoy ...` as given (as its user, uid 101).
            # --disable-hot-restart: on the host's network, Envoys of two projects would share
            # hot restart's domain socket (base id 0) and the second would not start.
            "command": ["envoy", "-c", f"{XDS_DIR}/bootstrap.json", "--disable-hot-restart"],
            # xds read-write only for Envoy's admin socket (envoy-admin.sock, 0600): on the host's network a
            # loopback admin port would be open to every local user
            "volumes": [f"xds:{XDS_DIR}", *sockets],
            # host networking: workers stay on the host's addresses
            "network_mode": "host",
            "depends_on": {"render": {"condition": "service_completed_successfully"}},
            "restart": "unless-stopped",
        },
    }
    volumes: dict[str, object] = {"xds": {}, **({"grpc-sockets": {}} if sockets else {})}
    if k8s.redis:
        services["redis"] = _redis_service(topo)
    doc = {"name": f"confgen-{topo.name}", "services": services, "volumes": volumes}
    return {
        "compose.yaml": dump(doc).encode(),
        "topology.yaml": topology_yaml(topo).encode(),
    }


def _redis_service(topo: Topology) -> dict[str, object]:
    """kubernetes.redis: a Redis for limits.store on the host's loopback, no persistence."""
    store = topo.limits.store
    if store is None or store.redis is None:
        raise DeployError([("kubernetes.redis", "there is no limits.store.redis for the rendered Redis to serve")])
    address = split_address(store.redis)
    assert address is not None  # the topology's pattern
    host, port = address
    if host != "localhost" and not (is_ip(host) and host.startswith("127.")):
        raise DeployError([("limits.store.redis", "with kubernetes.redis, compose runs Redis on the host's loopback "
                            f"(host networking, like Envoy and the sidecar): write 127.0.0.1:{port}")])
    command = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
               "--maxmemory", "200mb", "--maxmemory-policy", "volatile-ttl"]
    service: dict[str, object] = {"image": topo.kubernetes.redis_image, "command": command}
    if store.password_env is not None:
        # on the host's loopback every local user reaches it: the sidecar's password is its requirepass, read
        # from the environment by the container's shell ($$: not compose's own interpolation)
        shell = " ".join(shlex.quote(word) for word in command)
        service["command"] = ["sh", "-c", f'exec {shell} --requirepass "$${store.password_env}"']
        service["environment"] = [store.password_env]
        # the image's entrypoint drops to its redis user only when its first argument is redis-server: through
        # the shell it would stay root, on the host's network
        service["user"] = "999:999"
    return {**service, "network_mode": "host", "restart": "unless-stopped"}
