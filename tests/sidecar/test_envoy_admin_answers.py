"""sidecar.outputs.envoy_admin against hostile admin answers (a fake admin: answers a real Envoy does
not give on demand). Each is an answer that could not be had (None), never an exception out of the
daemon's cycle."""

from __future__ import annotations

import asyncio

from aiohttp import web

from confgen.runtime import free_port
from sidecar.outputs.envoy_admin import JSON_CAP, EnvoyAdmin

DEEP = b"[" * 200_000 + b"]" * 200_000  # past Python's recursion limit when parsed
HUGE = b'{"stats": [' + b'{"name": "a", "value": 1},' * (JSON_CAP // 25) + b'{"name": "a", "value": 1}]}'


def test_answers_too_deep_too_large_or_not_json_are_none() -> None:
    async def main() -> list[object]:
        answer = {"body": DEEP}

        async def handler(request: web.Request) -> web.Response:
            return web.Response(body=answer["body"], content_type="application/json")

        app = web.Application()
        app.router.add_get("/stats", handler)
        app.router.add_get("/runtime", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        out: list[object] = []
        try:
            async with EnvoyAdmin(f"http://127.0.0.1:{port}", timeout_s=10.0) as admin:
                for body in (DEEP, HUGE, b"\xff\xfe not json"):
                    answer["body"] = body
                    out += [await admin.stats("^a$"), await admin.runtime()]
                answer["body"] = b'{"stats": [{"name": "a", "value": 7}]}'
                out.append(await admin.stats("^a$"))
        finally:
            await runner.cleanup()
        return out

    out = asyncio.run(main())
    assert out[:6] == [None] * 6 and out[6] == {"a": 7}
