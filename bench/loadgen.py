"""Open-loop load generator, run as its own process (so it never shares a GIL with the fleet).

    python -m bench.loadgen JOB.json RESULT.json

JOB: {"targets": [url, ...], "requests": [{"i", "t", "body", "headers"}], "path": "/v1/completions",
      "deadline_s": float, "timeout_s": float, "max_in_flight": int}
Request i goes to targets[i % len(targets)] at start + t, whatever happened to earlier
requests (open loop). Nothing is sent after `deadline_s`; every request has `timeout_s`.
RESULT: one record per request: i, target, start, ttft, end (s from the run start), status,
worker (x-sim-worker), error.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp


async def _one(
    session: aiohttp.ClientSession, url: str, req: dict[str, Any], t0: float, timeout_s: float
) -> dict[str, Any]:
    rec: dict[str, Any] = {"i": req["i"], "target": url, "start": time.monotonic() - t0, "ttft": None,
                           "end": None, "status": 0, "worker": None, "error": None}
    stream = bool(req["body"].get("stream"))
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=req["body"], headers=req.get("headers") or {}) as resp:
                rec["status"] = resp.status
                rec["worker"] = resp.headers.get("x-sim-worker")
                if stream and resp.status == 200:
                    done = False
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue
                        if rec["ttft"] is None:
                            rec["ttft"] = time.monotonic() - t0 - rec["start"]
                        if line.strip() == b"data: [DONE]":
                            done = True
                    if not done:
                        rec["error"] = "truncated stream"
                else:
                    await resp.read()
                    if rec["ttft"] is None:
                        rec["ttft"] = time.monotonic() - t0 - rec["start"]
    except TimeoutError:
        rec["error"] = "timeout"
    except aiohttp.ClientError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
    rec["end"] = time.monotonic() - t0
    return rec


async def run_job(job: dict[str, Any]) -> list[dict[str, Any]]:
    targets = [t.rstrip("/") + job.get("path", "/v1/completions") for t in job["targets"]]
    deadline = float(job["deadline_s"])
    timeout_s = float(job.get("timeout_s", 60.0))
    limit = asyncio.Semaphore(int(job.get("max_in_flight", 2000)))
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    records: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.monotonic()
        tasks: list[asyncio.Task[dict[str, Any]]] = []

        async def fire(req: dict[str, Any], url: str) -> dict[str, Any]:
            async with limit:
                return await _one(session, url, req, t0, timeout_s)

        for req in job["requests"]:
            if req["t"] > deadline:
                break
            delay = req["t"] - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            url = targets[req["i"] % len(targets)]
            tasks.append(asyncio.create_task(fire(req, url)))
        records = list(await asyncio.gather(*tasks))
    return records


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    records = asyncio.run(run_job(job))
    Path(argv[1]).write_text(json.dumps(records))
    return 0


def run(job: dict[str, Any], workdir: Path, name: str = "load") -> list[dict[str, Any]]:
    """Run a job in a child process and return its records (bounded by deadline + timeout)."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, out_path = workdir / f"{name}.job.json", workdir / f"{name}.records.json"
    job_path.write_text(json.dumps(job))
    limit = float(job["deadline_s"]) + float(job.get("timeout_s", 60.0)) + 30.0
    proc = subprocess.run([sys.executable, "-m", "bench.loadgen", str(job_path), str(out_path)],
                          timeout=limit, check=False, capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    records: list[dict[str, Any]] = json.loads(out_path.read_text())
    return records


def start(job: dict[str, Any], workdir: Path, name: str = "load") -> tuple[subprocess.Popen[bytes], Path]:
    """Start a job in the background; `collect` waits for it."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, out_path = workdir / f"{name}.job.json", workdir / f"{name}.records.json"
    job_path.write_text(json.dumps(job))
    proc = subprocess.Popen([sys.executable, "-m", "bench.loadgen", str(job_path), str(out_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, out_path


def collect(proc: subprocess.Popen[bytes], out_path: Path, timeout: float) -> list[dict[str, Any]]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed ({proc.returncode}): {err.decode()[-2000:]}")
    records: list[dict[str, Any]] = json.loads(out_path.read_text())
    return records


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
