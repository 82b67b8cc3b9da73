"""Traffic classes under load, for the live tests of sheddable-first: closed-loop clients per
class through one URL, and the request each class sends."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

BODY = {"model": "sim-model", "prompt": "hold a slot", "max_tokens": 40}  # ~1 s at decode_ms=20
TIERS = {"sheddable": "bulk", "standard": "", "critical": "urgent"}  # the x-tier header each class sends
CLIENTS = {"sheddable": 12, "standard": 5, "critical": 3}  # 20 closed-loop clients on 6 slots


def post(url: str, tier: str) -> tuple[int, dict[str, str], bytes]:
    """One completion through `url` with the class's x-tier header: status, headers, body."""
    headers = {"content-type": "application/json", **({"x-tier": tier} if tier else {})}
    req = urllib.request.Request(url, data=json.dumps(BODY).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30.0) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


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
            status, headers, body = post(url, TIERS[cls])
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
