"""Many listening ports serving one metrics body: 1,000 endpoints without 1,000 engines.

    python -m bench._metrics_server BODY_FILE PORTS_OUT COUNT [--busy]

Binds COUNT loopback ports on one aiohttp runner, answers GET /metrics with the body and
GET /health with 200, writes the bound ports (JSON) to PORTS_OUT, serves until SIGTERM.

Idle (default): the body as given, every scrape the same (an idle fleet: the progress
counter never moves). `--busy`: a loaded fleet - `vllm:num_requests_running` is 4 and
`vllm:generation_tokens_total` rises on every scrape, as on engines generating tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import signal
import sys
from pathlib import Path

from aiohttp import web

_HEADERS = {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}


def busy_parts(body: bytes) -> tuple[bytes, bytes]:
    """The body cut around the token counter's value, with 4 requests running."""
    body = re.sub(rb"(?m)^(vllm:num_requests_running(?:\{[^}]*\})?) \S+$", rb"\1 4.0", body)
    found = re.search(rb"(?m)^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$", body)
    if found is None:
        raise ValueError("no vllm:generation_tokens_total in the body")
    return body[: found.start(1)], body[found.end(1):]


async def serve(body: bytes, ports_out: Path, count: int, busy: bool) -> None:
    tokens = itertools.count(1_000_000, 37)
    head, tail = busy_parts(body) if busy else (body, b"")

    async def metrics(request: web.Request) -> web.Response:
        if busy:
            return web.Response(body=b"%b%d.0%b" % (head, next(tokens), tail), headers=_HEADERS)
        return web.Response(body=body, headers=_HEADERS)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    for _ in range(count):
        await web.TCPSite(runner, "127.0.0.1", 0).start()
    ports = [int(a[1]) for a in runner.addresses]
    await asyncio.to_thread(ports_out.write_text, json.dumps(ports))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str]) -> int:
    asyncio.run(serve(Path(argv[0]).read_bytes(), Path(argv[1]), int(argv[2]), "--busy" in argv[3:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
