"""Traffic classes under load, for the live tests of sheddable-first: closed-loop clients per
class through one URL, and the request each class sends.

The class header (x-tier) is trusted from 127.0.0.1 only (`TRUSTED`: the listener's
trusted_headers; the load stands for the gateway that sets it); a `forged` client sends the
critical class's header from 127.0.0.2, a peer Envoy does not trust, so it must be standard."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

BODY = {"model": "sim-model", "prompt": "hold a slot", "max_tokens": 40}  # ~1 s at decode_ms=20
TIERS = {"sheddable": "bulk", "standard": "", "critical": "urgent", "forged": "urgent"}  # x-tier per class
SOURCES = {"forged": "127.0.0.2"}  # the peer address a class connects from (default 127.0.0.1)
CLIENTS = {"sheddable": 12, "standard": 5, "critical": 3}  # 20 closed-loop clients on 6 slots
TRUSTED = "trusted_headers: {names: [x-tier], from: [127.0.0.1/32]}"  # the listener's keys


def post(url: str, tier: str, source: str = "127.0.0.1") -> tuple[int, dict[str, str], bytes]:
    """One completion through `url` with the class's x-tier header, from the peer address
    `source`: status, headers, body."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None, url
    headers = {"content-type": "application/json", **({"x-tier": tier} if tier else {})}
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30.0, source_address=(source, 0))
    try:
        conn.request("POST", parts.path, body=json.dumps(BODY).encode(), headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@dataclass
class Outcome:
    statuses: dict[str, Counter[int]]
    shed: list[tuple[dict[str, str], bytes]] = field(default_factory=list)  # some sheddable 429s

    def refused(self) -> dict[str, float]:
        """Per class, the share of attempts answered 429."""
        return {cls: c[429] / max(1, sum(c.values())) for cls, c in self.statuses.items()}


def load(url: str, seconds: float, sample: Callable[[], None], clients: Mapping[str, int] = CLIENTS,
         keep: int = 20) -> Outcome:
    """`clients` closed-loop clients per class for `seconds` (at most 400 requests each; a
    refused one retries after 0.2 s, a served one at once), calling `sample` every 0.25 s
    meanwhile (a gauge or Envoy's runtime: sampling, not synchronisation)."""
    out = Outcome({cls: Counter() for cls in clients})
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(cls: str) -> None:
        for _ in range(400):
            if time.monotonic() >= deadline:
                return
            status, headers, body = post(url, TIERS[cls], SOURCES.get(cls, "127.0.0.1"))
            with lock:
                out.statuses[cls][status] += 1
                if status == 429 and cls == "sheddable" and len(out.shed) < keep:
                    out.shed.append((headers, body))
            if status == 429:
                time.sleep(0.2)

    with ThreadPoolExecutor(max_workers=sum(clients.values())) as pool:
        jobs = [pool.submit(client, cls) for cls, n in clients.items() for _ in range(n)]
        while time.monotonic() < deadline:
            sample()
            time.sleep(0.25)
        for job in jobs:
            job.result(timeout=60)
    return out
