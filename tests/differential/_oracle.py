"""The differential oracle: what plain `confgen validate` says vs what the real proxies say.

`judge(text)` loads a topology the way `confgen validate` does. A refused one must be
refused cleanly (TopologyError, every error pinned to file:line:col). An accepted one must
render for every target without raising, and the real Envoy (`envoy --mode validate` on
the inlined static bootstrap, as `confgen validate --envoy` runs it) and the real
`nginx -t` must both accept the render. Anything else is a bug, listed in `problems`.
"""

from __future__ import annotations

import tempfile
import traceback
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

from confgen import verify
from confgen.cli import TARGETS, render_files
from confgen.errors import DeployError, TopologyError
from confgen.model import Topology, grpc_tls
from confgen.topology import parse
from tests.support.certs import CertAuthority


@dataclass
class Outcome:
    accepted: bool = False
    errors: list[str] = field(default_factory=list)  # field paths of the loader's errors
    problems: list[str] = field(default_factory=list)  # disagreements and tracebacks: bugs


def _crash(where: str) -> str:
    return f"traceback in {where}:\n{traceback.format_exc(limit=6)}"


@cache
def _tls_files() -> tuple[str, str, str]:
    """A throwaway client certificate, its key and its CA (one per process, removed with it)."""
    directory = Path(tempfile.mkdtemp(prefix="confgen-fuzz-tls-"))
    ca = CertAuthority.create(directory)
    leaf = ca.issue("envoy", ["DNS:envoy"])
    return str(leaf.cert), str(leaf.key), str(ca.cert)


def _with_real_tls(topo: Topology) -> Topology:
    """The topology with its gRPC TLS files replaced by real ones on this machine. Envoy reads them when it
    checks a config, so a path that is well formed but holds no file here is refused by the real Envoy and
    not by plain validate, which reads no file (the deploy machine has them): not a disagreement. What is
    wrong with a path whatever the machine (a component past 255, /dev) validate refuses before this."""
    tls = grpc_tls(topo)
    if tls is None:
        return topo
    cert, key, ca = _tls_files()
    real = replace(tls, cert=cert, key=key, ca=ca)
    sidecar = replace(topo.sidecar, grpc_tls=real) if topo.sidecar.grpc_tls is not None else topo.sidecar
    xds = topo.envoy.xds
    envoy = replace(topo.envoy, xds=replace(xds, tls=real)) if xds.tls is not None else topo.envoy
    return replace(topo, sidecar=sidecar, envoy=envoy)


def judge(text: bytes, *, proxies: bool = True, name: str = "mutant.yaml") -> Outcome:
    out = Outcome()
    try:
        topo, _ = parse(text, name)
    except TopologyError as exc:
        out.errors = [d.path for d in exc.diagnostics if d.severity == "error"]
        if not out.errors:
            out.problems.append("TopologyError without an error diagnostic")
        out.problems += [f"error not pinned to a place: {d}" for d in exc.diagnostics if d.line < 1 or d.col < 1]
        return out
    except Exception:  # noqa: BLE001 - any other exception is the bug being looked for
        out.problems.append(_crash("validate"))
        return out
    out.accepted = True
    for target in TARGETS:
        try:
            render_files(topo, target, "/etc/confgen", None)
        except DeployError as exc:  # the target's own refusal (e.g. gateway-api without a picker pool)
            out.problems += [f"render --target {target} refused without a field path: {exc}"
                             for path, _ in exc.problems if not path]
        except Exception:  # noqa: BLE001
            out.problems.append(_crash(f"render --target {target}"))
    try:
        from confgen import nginx

        nginx.unsupported(topo)
    except Exception:  # noqa: BLE001
        out.problems.append(_crash("validate --nginx (unsupported)"))
    if proxies and not out.problems:
        topo = _with_real_tls(topo)
        for target in ("envoy", "nginx"):
            try:
                refused = verify.verify(topo, target)
            except Exception:  # noqa: BLE001
                out.problems.append(_crash(f"verify {target}"))
                continue
            out.problems += [f"validate said ok, {target} refused: {line}" for line in refused]
    return out
