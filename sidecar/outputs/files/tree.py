"""The whole Envoy tree the sidecar writes (startup, topology reload), and what it needs for it.

The sidecar's business is EDS. The tree around it (bootstrap, CDS, LDS) is rewritten so a
topology change reaches Envoy, but only LDS holds anything secret: the API keys, inline.
So the keys are read only when LDS must change:

- bootstrap, CDS and EDS are rendered from the topology; they hold no key.
- LDS comes from one of three sources (`LdsSource`):
    a mapping of keys  render it with them (a reload changed listeners, routes or auth);
    "try"              startup: render it if the keys happen to be readable, else keep it;
    "keep"             the file on disk, byte for byte (nothing read but that file).
  A kept LDS is never replaced by a render with placeholder keys (a known key would then
  open the door); if there is no LDS on disk at all, none is written and the caller says so.
- `keys_for_reload` decides, for a reload, whether LDS changes, and reads the keys only
  then; it raises SecretError when they are needed and cannot be read, so the caller keeps
  the running configuration.
- Paths inside the files (`config_dir_for_tree`) are the ones the bootstrap on disk
  already names, else the topology's envoy.config_dir, else the xDS directory made
  absolute: never a relative path Envoy would resolve against its own working directory,
  and never a rewrite of files that only differ by how the directory was spelled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from confgen import envoy
from confgen.envoy import layout
from confgen.errors import SecretError
from confgen.model import Topology
from confgen.secrets import resolve as resolve_secrets

__all__ = ["LdsSource", "config_dir_for_tree", "keys_for_reload", "lds_changes", "render_tree"]

LdsSource = Mapping[str, str] | Literal["try", "keep"]
LdsOutcome = Literal["rendered", "kept", "absent"]


def _placeholder_lds(topo: Topology) -> bytes | None:
    return envoy.render(topo, config_dir="/").get(layout.LDS)  # None: no LDS file (xds mode ads)


def lds_changes(old: Topology, new: Topology) -> bool:
    """Whether `new` needs another LDS than `old`: listeners, routes or auth differ.

    Key values are not compared (they are not read): both are rendered with placeholders;
    a change of where a key comes from (env name, file) counts as a change of auth.
    """
    return old.auth != new.auth or _placeholder_lds(old) != _placeholder_lds(new)


def keys_for_reload(old: Topology, new: Topology) -> LdsSource:
    """What the tree write after reloading `old` -> `new` takes LDS from.

    Raises SecretError when LDS changes, `new` has keys, and one cannot be read.
    """
    if not lds_changes(old, new):
        return "keep"
    return resolve_secrets(new) if new.auth is not None else {}


def config_dir_for_tree(xds_dir: Path, topo: Topology) -> str:
    """The directory named inside the files: as already rendered, else configured, else absolute."""
    try:
        boot = json.loads((xds_dir / layout.BOOTSTRAP).read_bytes())
        named = boot["dynamic_resources"]["lds_config"]["path_config_source"]["watched_directory"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        named = None
    if isinstance(named, str) and named.startswith("/"):
        return named
    return topo.envoy.config_dir or str(xds_dir.resolve())


def render_tree(topo: Topology, *, xds_dir: Path, config_dir: str,
                lds: LdsSource) -> tuple[dict[str, bytes], LdsOutcome, str]:
    """(files, how LDS was obtained, why) for a tree write into `xds_dir`; blocking (render, reads)."""
    if topo.auth is None:
        return envoy.render(topo, config_dir=config_dir, secrets={}), "rendered", ""
    why = "listeners and auth unchanged: the file on disk is kept"
    if not isinstance(lds, str):
        return envoy.render(topo, config_dir=config_dir, secrets=lds), "rendered", ""
    if lds == "try":
        try:
            return envoy.render(topo, config_dir=config_dir, secrets=resolve_secrets(topo)), "rendered", ""
        except SecretError as exc:
            why = f"API keys not at hand ({exc}): the file on disk is kept"
    files = envoy.render(topo, config_dir=config_dir)  # placeholder keys: LDS is replaced below
    if layout.LDS not in files:
        return files, "rendered", ""  # no LDS file to write (xds mode ads): no key in these files
    try:
        files[layout.LDS] = (xds_dir / layout.LDS).read_bytes()
    except OSError as exc:
        del files[layout.LDS]
        return files, "absent", f"no LDS written: the keys are needed and {layout.LDS} cannot be kept ({exc})"
    return files, "kept", why
