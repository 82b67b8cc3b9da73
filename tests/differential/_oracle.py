"""The differential oracle: what plain `confgen validate` says vs what the real proxies say.

`judge(text)` loads a topology the way `confgen validate` does. A refused one must be
refused cleanly (TopologyError, every error pinned to file:line:col). An accepted one must
render for every target without raising, and the real Envoy (`envoy --mode validate` on
the inlined static bootstrap, as `confgen validate --envoy` runs it) and the real
`nginx -t` must both accept the render. Anything else is a bug, listed in `problems`.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

from confgen import verify
from confgen.cli import TARGETS, render_files
from confgen.errors import DeployError, TopologyError
from confgen.topology import parse


@dataclass
class Outcome:
    accepted: bool = False
    errors: list[str] = field(default_factory=list)  # field paths of the loader's errors
    problems: list[str] = field(default_factory=list)  # disagreements and tracebacks: bugs


def _crash(where: str) -> str:
    return f"traceback in {where}:\n{traceback.format_exc(limit=6)}"


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
        for target in ("envoy", "nginx"):
            try:
                refused = verify.verify(topo, target)
            except Exception:  # noqa: BLE001
                out.problems.append(_crash(f"verify {target}"))
                continue
            out.problems += [f"validate said ok, {target} refused: {line}" for line in refused]
    return out
