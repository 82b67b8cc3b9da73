"""sidecar.outputs.files.tree: which tree write needs the API keys, and that a kept LDS is the disk's bytes
(never a placeholder render); paths inside the files are never relative."""

from __future__ import annotations

from pathlib import Path

import pytest

from confgen import envoy, parse_topology
from confgen.errors import SecretError
from confgen.model import Topology
from confgen.output import write_tree
from sidecar.outputs.files.tree import config_dir_for_tree, keys_for_reload, lds_changes, render_tree

BASE = """\
version: 1
name: tree
admin: {address: 127.0.0.1, port: 9901}
listeners:
  - {name: public, address: 127.0.0.1, port: 8080}
pools:
  - name: chat
    engine: vllm
    models: [m]
    capacity: 4
    workers: [127.0.0.1:8000]
auth:
  api_keys:
    - client: web
      env: CONFGEN_TREE_TEST_KEY
"""


def _topo(text: str) -> Topology:
    return parse_topology(text.encode())[0]


def test_only_listener_or_auth_changes_need_the_keys() -> None:
    """A capacity change keeps LDS; a new listener or another key source changes it."""
    base = _topo(BASE)
    assert not lds_changes(base, _topo(BASE.replace("capacity: 4", "capacity: 8")))
    assert lds_changes(base, _topo(BASE.replace("listeners:\n", "listeners:\n  - {name: b, port: 8081}\n")))
    assert lds_changes(base, _topo(BASE.replace("CONFGEN_TREE_TEST_KEY", "CONFGEN_TREE_OTHER")))


def test_keys_for_reload_reads_keys_only_when_lds_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """No change of LDS: "keep" without reading the env; a change without the key raises
    SecretError naming the field; with it, the keys."""
    monkeypatch.delenv("CONFGEN_TREE_TEST_KEY", raising=False)
    base = _topo(BASE)
    assert keys_for_reload(base, _topo(BASE.replace("capacity: 4", "capacity: 8"))) == "keep"
    changed = _topo(BASE.replace("listeners:\n", "listeners:\n  - {name: b, port: 8081}\n"))
    with pytest.raises(SecretError, match=r"auth.api_keys\[0\].env"):
        keys_for_reload(base, changed)
    monkeypatch.setenv("CONFGEN_TREE_TEST_KEY", "k-1")
    assert keys_for_reload(base, changed) == {"web": "k-1"}


def test_kept_lds_is_the_disk_bytes_and_absent_lds_is_not_invented(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """"try" without keys keeps the LDS on disk byte for byte; with no LDS on disk none is
    written (a placeholder key would let anyone knowing it in)."""
    monkeypatch.delenv("CONFGEN_TREE_TEST_KEY", raising=False)
    topo = _topo(BASE)
    real = envoy.render(topo, config_dir=str(tmp_path), secrets={"web": "real-key"})
    write_tree(real, tmp_path)
    files, how, _ = render_tree(topo, xds_dir=tmp_path, config_dir=str(tmp_path), lds="try")
    assert how == "kept" and files == real
    (tmp_path / "lds.json").unlink()
    files, how, why = render_tree(topo, xds_dir=tmp_path, config_dir=str(tmp_path), lds="keep")
    assert how == "absent" and "lds.json" not in files and "lds.json" in why
    assert all(b"placeholder-key" not in data for data in files.values())


def test_config_dir_comes_from_the_bootstrap_on_disk_else_absolute(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory named in the bootstrap on disk wins (as rendered); without one, the
    xDS directory resolved: never relative, even for a relative --xds-dir."""
    topo = _topo(BASE)
    monkeypatch.chdir(tmp_path)
    assert config_dir_for_tree(Path("out"), topo) == str(tmp_path.resolve() / "out")
    write_tree(envoy.render(topo, config_dir="/srv/envoy"), tmp_path / "out")
    assert config_dir_for_tree(Path("out"), topo) == "/srv/envoy"
