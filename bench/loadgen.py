"""Open-loop load generator, run as its own process (so it never shares a GIL with the fleet).

    python -m bench.loadgen JOB.json RESULT.json

JOB: {"targets": [url, ...], "requests": [{"i", "t", "body", "headers", "after"?}],
      "path": "/v1/completions", "deadline_s": float, "timeout_s": float, "max_in_flight": int}

Request i is due at start + t (its SCHEDULED send time) and goes to targets[i % len(targets)],
whatever happened to earlier requests (open loop). A request with `after` = j (the previous
turn of a conversation) is sent no earlier than request j's end: a chat client waits for the
answer. Latency is measured from the scheduled time, never from the moment the request
actually left: when this process, the semaphore or a previous turn holds a request back, the
wait counts against the system under test (no coordinated omission).

Bounded in count (the job's requests), in sending time (nothing is sent after `deadline_s`;
later requests are recorded as "not sent") and in total time (every request has `timeout_s`,
the whole run `deadline_s + timeout_s + 5`).

RESULT: one record per request: i, target, sched, start, ttft, end (s from the run start),
status, worker (x-sim-worker), error, out (the request's output tokens: its `out`, else its
max_tokens; the simulator generates exactly that many). `ttft` is from `sched` too: the
first streamed `data:` line (the first byte of the answer for a non-streamed request).
"""

from __future__ import annotations

import asyncio
import json
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

_TARGETS_WAIT_S = 300.0


def _record(req: dict[str, Any], url: str) -> dict[str, Any]:
    out = req.get("out", req["body"].get("max_tokens"))
    return {"i": req["i"], "target": url, "sched": float(req["t"]), "start": None, "ttft": None, "end": None,
            "status": 0, "worker": None, "error": None, "out": out, "chunks": 0, "work": req.get("work")}


async def _one(session: aiohttp.ClientSession, url: str, req: dict[str, Any], rec: dict[str, Any], t0: float,
               timeout_s: float) -> None:
    rec["start"] = time.monotonic() - t0
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
                            rec["ttft"] = time.monotonic() - t0 - rec["sched"]
                        if line.strip() == b"data: [DONE]":
                            done = True
                        else:
                            rec["chunks"] += 1  # one streamed chunk per token (the simulator's engines)
                    if not done:
                        rec["error"] = "truncated stream"
                else:
                    await resp.read()
                    if rec["ttft"] is None:
                        rec["ttft"] = time.monotonic() - t0 - rec["sched"]
    except TimeoutError:
        rec["error"] = "timeout"
    except aiohttp.ClientError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
    rec["end"] = time.monotonic() - t0


async def run_job(job: dict[str, Any]) -> list[dict[str, Any]]:
    targets = [t.rstrip("/") + job.get("path", "/v1/completions") for t in job["targets"]]
    deadline = float(job["deadline_s"])
    timeout_s = float(job.get("timeout_s", 60.0))
    limit = asyncio.Semaphore(int(job.get("max_in_flight", 2000)))
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    requests: list[dict[str, Any]] = sorted(job["requests"], key=lambda r: r["t"])
    records = {r["i"]: _record(r, targets[r["i"] % len(targets)]) for r in requests}
    finished = {r["i"]: asyncio.Event() for r in requests}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.monotonic()

        async def fire(req: dict[str, Any]) -> None:
            rec = records[req["i"]]
            try:
                after = req.get("after")
                if after is not None and after in finished:
                    await finished[after].wait()
                if time.monotonic() - t0 > deadline + timeout_s:
                    rec["error"] = "not sent"
                    return
                async with limit:
                    await _one(session, rec["target"], req, rec, t0, timeout_s)
            finally:
                finished[req["i"]].set()

        tasks: list[asyncio.Task[None]] = []
        try:
            async with asyncio.timeout(deadline + timeout_s + 5.0):
                for req in requests:
                    if req["t"] > deadline:
                        records[req["i"]]["error"] = "not sent"
                        finished[req["i"]].set()
                        continue
                    delay = req["t"] - (time.monotonic() - t0)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(fire(req)))
                await asyncio.gather(*tasks)
        except TimeoutError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for rec in records.values():
                if rec["end"] is None and rec["error"] is None:
                    rec["error"] = "timeout"
                    rec["end"] = time.monotonic() - t0
    return [records[r["i"]] for r in requests]


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    if job.get("targets") is None:
        # Started ahead of the proxies (its imports out of the measured run's way): the targets
        # come as one JSON line on stdin once they are ready.
        ready, _, _ = select.select([sys.stdin], [], [], _TARGETS_WAIT_S)
        line = sys.stdin.readline() if ready else ""
        if not line.strip():
            print("no targets on stdin", file=sys.stderr)
            return 2
        job["targets"] = json.loads(line)
    records = asyncio.run(run_job(job))
    Path(argv[1]).write_text(json.dumps(records))
    return 0


def _wall_limit(job: dict[str, Any]) -> float:
    return float(job["deadline_s"]) + float(job.get("timeout_s", 60.0)) + 30.0


def run(job: dict[str, Any], workdir: Path, name: str = "load") -> list[dict[str, Any]]:
    """Run a job in a child process and return its records (bounded by deadline + timeout)."""
    proc, out_path = start(job, workdir, name)
    return collect(proc, out_path, _wall_limit(job))


def start(job: dict[str, Any], workdir: Path, name: str = "load") -> tuple[subprocess.Popen[bytes], Path]:
    """Start a job in the background; `collect` waits for it. A job with "targets": None waits
    (at most _TARGETS_WAIT_S) for `go(proc, targets)` before its clock starts."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, out_path = workdir / f"{name}.job.json", workdir / f"{name}.records.json"
    job_path.write_text(json.dumps(job))
    waits = job.get("targets") is None
    proc = subprocess.Popen([sys.executable, "-m", "bench.loadgen", str(job_path), str(out_path)],
                            stdin=subprocess.PIPE if waits else subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    return proc, out_path


def go(proc: subprocess.Popen[bytes], targets: list[str]) -> None:
    """Hand the targets to a load generator started with "targets": None: its run starts now."""
    if proc.stdin is None:
        raise RuntimeError("this load generator was started with its targets")
    proc.stdin.write((json.dumps(targets) + "\n").encode())
    proc.stdin.flush()  # left open: `collect` (communicate) closes it


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
