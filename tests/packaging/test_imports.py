"""The product's module map: no import cycles, and every import runs down the documented layers.

Every `import` / `from ... import` in confgen/ and sidecar/ counts, wherever it stands
(module level, inside a function, under TYPE_CHECKING): a lazy import that closes a loop
is still a loop a reader has to untangle. The layers of both packages are the ones drawn in
docs/architecture.md; a module may import its own layer or the ones below it, never above.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("confgen", "sidecar")

# The sidecar's layers, bottom first (docs/architecture.md "The sidecar by stages").
SIDECAR_LAYERS: tuple[tuple[str, ...], ...] = (
    ("sidecar.logs",),
    ("sidecar.observe",),
    ("sidecar.decide",),
    ("sidecar.fleet",),
    ("sidecar.config",),
    ("sidecar.outputs",),
    ("sidecar.daemon",),
    ("sidecar.serve",),
    ("sidecar.main", "sidecar.drain"),
)
# confgen's layers, bottom first (docs/architecture.md "Layers of confgen"): a name is a module or
# a package with everything in it; "confgen" alone is the package's own __init__ (the public API).
CONFGEN_LAYERS: tuple[tuple[str, ...], ...] = (
    # foundations: the error tree, names and field specs, YAML, atomic output, the binaries, endpoints
    ("confgen.errors", "confgen._names", "confgen._fields", "confgen._diff", "confgen._yaml_words",
     "confgen._yaml", "confgen.binaries", "confgen.output", "confgen.endpoints"),
    # the typed model and what is derived from its types alone
    ("confgen.model", "confgen._decode", "confgen.schema"),
    # resolved once from the model: the plan, policies, limits, secrets, and the checks over them
    ("confgen.plan", "confgen.balancing", "confgen.limits", "confgen.secrets", "confgen._pod_fit",
     "confgen._rejection", "confgen._openai", "confgen._edge_checks", "confgen._checks"),
    # the front door: load / parse, and the public API
    ("confgen.topology", "confgen"),
    # pure renderers (model + plan -> files) and the simulated engines
    ("confgen.envoy", "confgen.nginx", "confgen.deploy", "confgen.simulate"),
    # real-proxy checks, the target registry, the process rig
    ("confgen.proxycheck", "confgen.targets", "confgen.verify", "confgen.runtime"),
    # commands
    ("confgen.demo", "confgen.cli", "confgen.__main__"),
)
# Inside outputs: the interfaces and shared clients every output may use; each output's own package.
OUTPUT_SHARED = ("sidecar.outputs.contract", "sidecar.outputs.registry",
                 "sidecar.outputs.envoy_admin",
                 "sidecar.outputs.grpc", "sidecar.outputs.tls")
INTERFACES = ("sidecar.outputs.contract",)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _imports(name: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """The product modules `name` imports (resolved: `from a.b import c` is a.b.c when c is a module)."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                targets.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.add(sub if sub in known else source)
    return {t for t in targets if t in known and t != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _registered(path: Path, known: Mapping[str, Path]) -> set[str]:
    """The product modules a module's registries name for `importlib.import_module`: the values
    of its dict literals ("pkg.mod" or "pkg.mod:function") that are module names."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    named = {value.value.partition(":")[0] for node in ast.walk(tree) if isinstance(node, ast.Dict)
             for value in node.values if isinstance(value, ast.Constant) and isinstance(value.value, str)}
    return {n for n in named if n in known}


def calls() -> dict[str, set[str]]:
    """`graph()` plus the edges the registries call through `import_module` (the targets, the
    publishers, the services): a loop through a registry is a loop a reader has to untangle too.
    A registered module's import of its own package (the registry's shared types, defined before
    any lookup runs) is how a registry works and is left out; a loop leaving the package is not."""
    known = modules()
    edges = graph()
    for name, path in known.items():
        edges[name] |= _registered(path, known) - {name}
    return {src: {dst for dst in targets if not src.startswith(dst + ".")} for src, targets in edges.items()}


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _layer(module: str) -> int | None:
    for rank, prefixes in enumerate(SIDECAR_LAYERS):
        if any(_within(module, p) for p in prefixes):
            return rank
    return None


def _confgen_layer(module: str) -> int | None:
    for rank, names in enumerate(CONFGEN_LAYERS):
        if module in names or any(n != "confgen" and _within(module, n) for n in names):
            return rank
    return None


def _output_package(module: str) -> str | None:
    """sidecar.outputs.<name> for a module of one output (None for the shared modules)."""
    if not _within(module, "sidecar.outputs") or any(_within(module, s) for s in OUTPUT_SHARED):
        return None
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) > 2 else None


def violations(edges: Mapping[str, Iterable[str]]) -> list[str]:
    """Imports that run up the documented layering, with the reason."""
    bad: list[str] = []
    for src, targets in sorted(edges.items()):
        for dst in sorted(targets):
            if _within(src, "confgen") and _within(dst, "sidecar"):
                bad.append(f"{src} -> {dst}: confgen never imports sidecar")
                continue
            if _within(src, "confgen") and _within(dst, "confgen"):
                ranks = _confgen_layer(src), _confgen_layer(dst)
                if ranks[0] is None or ranks[1] is None:
                    bad.append(f"{src} -> {dst}: a confgen module outside the documented layers")
                elif ranks[1] > ranks[0]:
                    bad.append(f"{src} -> {dst}: imports a layer above its own")
                continue
            if not (_within(src, "sidecar") and _within(dst, "sidecar")) or src == "sidecar":
                continue
            src_rank, dst_rank = _layer(src), _layer(dst)
            if src_rank is None or dst_rank is None:
                bad.append(f"{src} -> {dst}: a sidecar module outside the documented layers")
            elif dst_rank > src_rank:
                bad.append(f"{src} -> {dst}: imports a layer above its own")
            elif src in INTERFACES and _output_package(dst) is not None:
                bad.append(f"{src} -> {dst}: an interface module imports an implementation")
            elif (pkg := _output_package(dst)) is not None and _output_package(src) not in (None, pkg):
                bad.append(f"{src} -> {dst}: one output imports another (share through the interfaces)")
            elif _output_package(src) is None and src_rank == dst_rank and _output_package(dst) is not None \
                    and src not in INTERFACES:
                bad.append(f"{src} -> {dst}: a shared output module imports an implementation")
    return bad


def test_the_product_has_no_import_cycle() -> None:
    edges = graph()
    assert "sidecar.daemon" in edges and "confgen.cli" in edges  # the map covers the product
    assert cycles(edges) == []


def test_no_call_loop_runs_through_a_registry() -> None:
    """E.g. confgen.verify -> confgen.targets -(import_module)-> confgen.targets.envoy -> confgen.verify."""
    edges = calls()
    assert "confgen.targets.envoy" in edges["confgen.targets"]  # the registry edges are seen
    assert cycles(edges) == []


def test_every_import_runs_down_the_layers() -> None:
    assert violations(graph()) == []


def test_every_sidecar_module_is_in_a_layer() -> None:
    stray = [m for m in modules() if _within(m, "sidecar") and m != "sidecar" and _layer(m) is None]
    assert stray == []


def test_every_confgen_module_is_in_a_layer() -> None:
    stray = [m for m in modules() if _within(m, "confgen") and _confgen_layer(m) is None]
    assert stray == []


def test_the_checks_can_fail() -> None:
    """A cycle and each kind of upward import are seen (the checks above are not vacuous)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    found = violations({
        "sidecar.observe.probe": {"sidecar.daemon"},
        "sidecar.outputs.contract": {"sidecar.outputs.xds.publisher"},
        "sidecar.outputs.nginx.publisher": {"sidecar.outputs.files.tree"},
        "confgen.cli": {"sidecar.main"},
        "confgen.model": {"confgen.plan", "confgen._fields"},
        "confgen.envoy._listener": {"confgen.targets", "confgen.envoy._proto", "confgen.plan"},
        "sidecar.daemon": {"sidecar.outputs.contract", "sidecar.fleet"},
    })
    assert [v.split(":")[1].strip() for v in found] == [
        "confgen never imports sidecar",
        "imports a layer above its own",
        "imports a layer above its own",
        "imports a layer above its own",
        "an interface module imports an implementation",
        "one output imports another (share through the interfaces)",
    ]
