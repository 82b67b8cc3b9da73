"""Many listening ports serving one fixed metrics body: 1,000 endpoints without 1,000 engines.

    python -m bench._metrics_server BODY_FILE PORTS_OUT COUNT

Binds COUNT loopback ports on one aiohttp runner, answers GET /metrics with the body and
GET /health with 200, writes the bound ports (JSON) to PORTS_OUT, serves until SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from aiohttp import web


async def serve(body: bytes, ports_out: Path, count: int) -> None:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

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
    asyncio.run(serve(Path(argv[0]).read_bytes(), Path(argv[1]), int(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
