"""The nginx publisher's `nginx -t` step: a candidate the real nginx refuses is kept refused (not retested
until its render changes); a test that could not run or finish (here a binary that hangs: a fault the real
nginx does not make on demand) refuses nothing, so the same candidate is tried again."""

from __future__ import annotations

import asyncio
from pathlib import Path

from confgen.binaries import find_nginx
from confgen.topology import parse
from sidecar.config.nginx import NginxSettings
from sidecar.outputs.nginx.publisher import NginxPublisher

TOPOLOGY = b"""
version: 1
name: t
listeners: [{name: public, port: 8080}]
pools: [{name: chat, engine: vllm, models: [m], workers: ["127.0.0.1:8000"]}]
"""


def _publisher(tmp_path: Path, binary: Path, timeout_s: float) -> tuple[NginxPublisher, Path]:
    topo, _ = parse(TOPOLOGY, "t.yaml")
    live = tmp_path / "upstreams" / "chat.conf"
    live.parent.mkdir()
    live.write_text("server 127.0.0.1:8000;\n")
    conf = tmp_path / "nginx.conf"
    conf.write_text(f"events {{}}\nhttp {{\n upstream chat {{\n  include {live};\n }}\n}}\n")
    settings = NginxSettings(directory=tmp_path, conf=conf, prefix=tmp_path, pid=99999, binary=binary,
                             test_timeout_s=timeout_s)
    return NginxPublisher(settings, lambda: topo), live


def test_a_test_that_cannot_finish_refuses_nothing_and_a_real_refusal_is_kept(tmp_path: Path) -> None:
    """Found by review: a single `nginx -t` that timed out (or a missing binary) kept the candidate refused
    until the render changed, so health changes (a dead worker marked down) never reached nginx."""
    hang = tmp_path / "hanging-nginx"
    hang.write_text("#!/bin/sh\nexec sleep 30\n")
    hang.chmod(0o755)
    candidate = {"chat": b"server 127.0.0.1:8000 down;\nserver 127.0.0.1:8001;\n"}

    async def main() -> tuple[bool, bool, dict[str, bytes], bool, bool, dict[str, bytes]]:
        hung, _ = _publisher(tmp_path / "a", hang, 0.3)
        first = await hung._check(candidate)
        real, _ = _publisher(tmp_path / "b", find_nginx(), 30.0)
        good = await real._check(candidate)
        bad = await real._check({"chat": b"server 127.0.0.1:8000 max_fails=x;\n"})
        return first.ok, first.refused, dict(hung._refused), good.ok, bad.refused, dict(real._refused)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ok, refused, kept, good, real_refusal, real_kept = asyncio.run(main())
    assert not ok and not refused and kept == {}  # tried again next time
    assert good
    assert real_refusal and list(real_kept) == ["chat"]


def test_one_pools_bad_file_holds_back_no_other_pool_and_is_blamed_alone(tmp_path: Path) -> None:
    """Found by review: a batch of several pools' candidates that nginx -t refused was refused whole, every
    pool blamed and kept refused. Each pool is then tested alone: the good ones go ahead, the bad one alone
    is kept refused."""
    topo, _ = parse(TOPOLOGY.replace(b'pools: [{name: chat', b'pools: [{name: other, engine: vllm, models: [o], '
                                     b'workers: ["127.0.0.1:8001"]}, {name: chat'), "t.yaml")
    up = tmp_path / "upstreams"
    up.mkdir()
    for pool in ("chat", "other"):
        (up / f"{pool}.conf").write_text("server 127.0.0.1:8000;\n")
    conf = tmp_path / "nginx.conf"
    conf.write_text("events {}\nhttp {\n" + "".join(
        f" upstream {pool} {{\n  include {up / (pool + '.conf')};\n }}\n" for pool in ("chat", "other")) + "}\n")
    settings = NginxSettings(directory=tmp_path, conf=conf, prefix=tmp_path, pid=99999, binary=find_nginx())
    publisher = NginxPublisher(settings, lambda: topo)
    good, bad = b"server 127.0.0.1:8000 down;\nserver 127.0.0.1:8001;\n", b"server 127.0.0.1:8000 max_fails=x;\n"

    async def main() -> dict[str, bytes]:
        return await publisher._checked({"chat": good, "other": bad})

    assert asyncio.run(main()) == {"chat": good}
    assert publisher._refused == {"other": bad}
