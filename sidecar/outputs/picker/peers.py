"""Picker replicas tell each other where they sent what, so every replica knows the whole fleet.

A picker sees only the requests through its own Envoy: with two Envoys (each with its own
sidecar, `--ingresses 2`) a conversation's turns alternate between two pickers, each of which
holds half of its history, and each counts only its own requests in flight between two engine
scrapes. With `--picker-peer TARGET` (repeatable: the other replicas' gRPC services) a picker
streams to each peer, every `flush_s`:

- the placements it made since the last batch: (pool, endpoint, the prompt's block hashes),
  which the peer adds to that endpoint's prefix index as if it had sent the request itself;
- its requests in flight per endpoint (the whole map, every batch: a heartbeat when idle),
  which the peer counts as load beside its own until the next batch replaces it, or drops
  when the stream ends or falls silent for `stale_s` (a timer, not the next batch of someone
  else); per replica, so one replica reached over two links counts once (`PeerLoads`).

Targets: `unix:PATH` (a peer on this host), `HOST:PORT` (one peer over mTLS), or `dns:HOST:PORT`:
every address HOST resolves to, resolved again every `resolve_s` (a Kubernetes headless Service
names every proxy pod of a Deployment that scales). A link per address: one that leaves the
answer is closed, a new one dialed; a failed or timed-out lookup keeps the links as they are;
at most `max_peers` addresses (the rest are logged, not dialed). Over mTLS each address is
checked against HOST, the name the shared certificate carries. This replica's own address is in
the answer too: that link ends as any link to itself does (below) and is not dialed again while
the address stays.

Wire: one client-streaming RPC, `/confgen.picker.v1.Peers/Share`, on the sidecar's one gRPC
server and its one transport (a Unix socket in the private socket directory: a process of the
sidecar's user; or mutual TLS: the peer presents the sidecar's own certificate, which the CA
of `--grpc-client-ca` must sign, and is verified against that CA). A batch is one JSON object:

    {"v": 1, "replica": id, "picks": [[pool, "ip:port", [hash, ...]], ...], "in_flight": {pool: {"ip:port": n}}}

`replica` is a random id each picker draws at start: a stream from the replica itself (a peer list
that names every replica, as the Kubernetes render gives each control-plane pod, or a mistake) is
ended with FAILED_PRECONDITION, and that link stops for good instead of counting its own load twice.

Over mTLS a peer must present this sidecar's own certificate (the same leaf: the replicas share
one Secret); an Envoy's certificate, which the same CA signs, may call the picker but is refused
here (PERMISSION_DENIED). Over the Unix socket only the sidecar's user can connect.

Bounded both ways: a sender keeps at most `max_pending` placements per peer (the oldest are
dropped and counted), sends at most `max_batch` of them a batch; a receiver refuses a batch
over `MAX_BATCH_BYTES` or with more than `MAX_PICKS` placements, `MAX_HASHES` hashes a placement
or `MAX_ENDPOINTS` in-flight entries, a hash outside 64 bits or a count outside 0..`MAX_IN_FLIGHT`
(the stream ends with INVALID_ARGUMENT); a pool or endpoint it does not know is skipped. What a
peer can do is what the picker does itself: add hashes to an index and load to an endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from confgen.errors import ConfgenError
from confgen.model import join_address
from sidecar.config.tls import TlsFiles, split_dns
from sidecar.logs import log_event

from .datastore import Datastore

__all__ = ["MAX_HASHES", "METHOD", "PeerLimits", "PeerLinks", "PeerServicer", "decode", "encode", "resolve"]

_log = logging.getLogger("sidecar.picker.peers")

SERVICE = "confgen.picker.v1.Peers"
METHOD = f"/{SERVICE}/Share"
MAX_BATCH_BYTES = 1024 * 1024
MAX_PICKS = 1024
MAX_HASHES = 1024  # a prompt hashes at most limits.max_blocks (256) blocks
MAX_ENDPOINTS = 20_000
MAX_IN_FLIGHT = 1_000_000
_U64 = 2 ** 64


class BatchError(ConfgenError):
    """A batch that breaks the format or its caps (the stream is ended)."""


SELF = "this is the replica itself"

Resolver = Callable[[str, int], Awaitable[Collection[str]]]


async def resolve(host: str, port: int) -> Collection[str]:
    """The addresses `host` resolves to (the system resolver, in the loop's executor: never blocks the loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return {str(info[4][0]) for info in infos}


@dataclass(frozen=True, slots=True)
class Batch:
    replica: str
    picks: tuple[tuple[str, str, tuple[int, ...]], ...]
    in_flight: Mapping[str, Mapping[str, int]]


def encode(replica: str, picks: Sequence[tuple[str, str, Sequence[int]]],
           in_flight: Mapping[str, Mapping[str, int]]) -> bytes:
    return json.dumps({"v": 1, "replica": replica, "picks": [[p, a, list(h)] for p, a, h in picks],
                       "in_flight": in_flight}, separators=(",", ":")).encode()


def decode(data: bytes) -> Batch:
    """The batch in `data`; BatchError naming what is wrong."""
    if len(data) > MAX_BATCH_BYTES:
        raise BatchError(f"batch of {len(data)} bytes (at most {MAX_BATCH_BYTES})")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BatchError(f"not JSON: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("v") != 1:
        raise BatchError("not a version-1 batch")
    replica = raw.get("replica")
    if not isinstance(replica, str) or not 0 < len(replica) <= 64:
        raise BatchError("replica: a string of 1-64 characters")
    picks, flights = raw.get("picks", []), raw.get("in_flight", {})
    if not isinstance(picks, list) or len(picks) > MAX_PICKS:
        raise BatchError(f"picks: a list of at most {MAX_PICKS}")
    out = []
    for item in picks:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and isinstance(item[1], str) and isinstance(item[2], list) and len(item[2]) <= MAX_HASHES):
            raise BatchError(f"a pick is [pool, address, [at most {MAX_HASHES} hashes]]")
        hashes = item[2]
        if not all(type(h) is int and 0 <= h < _U64 for h in hashes):
            raise BatchError("a hash is an integer of 64 bits")
        out.append((item[0], item[1], tuple(hashes)))
    if not isinstance(flights, dict):
        raise BatchError("in_flight: an object of pools")
    seen = 0
    loads: dict[str, dict[str, int]] = {}
    for pool, per in flights.items():
        if not isinstance(per, dict):
            raise BatchError("in_flight: each pool an object of address: count")
        seen += len(per)
        if seen > MAX_ENDPOINTS:
            raise BatchError(f"in_flight: at most {MAX_ENDPOINTS} endpoints")
        if not all(isinstance(a, str) and type(n) is int and 0 <= n <= MAX_IN_FLIGHT for a, n in per.items()):
            raise BatchError(f"in_flight: counts are integers in 0..{MAX_IN_FLIGHT}")
        loads[pool] = per
    return Batch(replica, tuple(out), loads)


class PeerLoads:
    """The peers' requests in flight, per replica, summed onto the datastore's endpoints.

    Keyed by the replica a batch names, not by the stream it came on: one replica reached over two
    links (a dual-stack name resolving to an A and an AAAA record, or one peer listed twice) sends its
    whole map on each, and counting both would count its requests twice; the latest batch wins. A
    replica whose batches stop (frozen, partitioned: its stream may stay open for the transport's
    keepalive, ~40 s) counts for nothing `stale_s` after its last batch (`expire_after`)."""

    def __init__(self, store: Datastore, clock: Callable[[], float], stale_s: float) -> None:
        self._store = store
        self._clock = clock
        self.stale_s = stale_s
        # replica (or "#stream" for a batch naming none) -> (the stream it came on, when, its map)
        self._replicas: dict[str, tuple[int, float, Mapping[str, Mapping[str, int]]]] = {}

    def set(self, stream: int, loads: Mapping[str, Mapping[str, int]], replica: str | None = None) -> None:
        self._replicas[replica or f"#{stream}"] = (stream, self._clock(), loads)
        self.apply()

    def drop(self, stream: int) -> None:
        """The stream ended: the loads it last brought count no more (another link of the same replica
        brings them again with its next batch)."""
        gone = [key for key, (owner, _, _) in self._replicas.items() if owner == stream]
        for key in gone:
            del self._replicas[key]
        if gone:
            self.apply()

    def expire_after(self, delay_s: float | None = None) -> asyncio.TimerHandle:
        """Run `apply` once `delay_s` (default: just past stale_s) has passed on the running loop: the
        receiver arms this after each batch, so a replica gone silent expires on time."""
        return asyncio.get_running_loop().call_later(
            self.stale_s * 1.01 + 0.001 if delay_s is None else delay_s, self.apply)

    def apply(self) -> None:
        """Every endpoint's `peers` from the live replicas (one silent for stale_s counts for nothing)."""
        now = self._clock()
        for key in [k for k, (_, at, _) in self._replicas.items() if now - at > self.stale_s]:
            del self._replicas[key]
        totals: dict[tuple[str, str], int] = {}
        for _, _, loads in self._replicas.values():
            for pool, per in loads.items():
                for address, n in per.items():
                    totals[(pool, address)] = totals.get((pool, address), 0) + n
        self._store.set_peer_loads(totals)


class PeerServicer:
    """The receiving side: each stream is one peer; its batches go into the datastore."""

    def __init__(self, store: Datastore, loads: PeerLoads, on_batch: Callable[[int, int], None] | None = None,
                 *, replica: str = "", own_cert: Path | None = None) -> None:
        self.replica = replica  # this picker's own id: a stream carrying it is refused
        # over mTLS, a peer presents this sidecar's own certificate (the replicas share one, as a
        # StatefulSet's or a Deployment's pods do): any other certificate the CA signs (an Envoy's)
        # may call the picker, never move its index or its loads
        self._own_cert = own_cert
        self._store = store
        self._loads = loads
        self._ids = itertools.count()
        self._on_batch = on_batch  # (placements applied, skipped): the metrics
        self.streams = 0

    async def share(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        if self._own_cert is not None and not await self._is_replica(context):
            log_event(_log, logging.WARNING, "picker.peer_refused", reason="not this sidecar's certificate")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "confgen picker peers: a peer presents this sidecar's own certificate")
        stream = next(self._ids)
        self.streams += 1
        expiry: asyncio.TimerHandle | None = None
        try:
            async for data in requests:
                try:
                    batch = decode(data)
                except BatchError as exc:
                    log_event(_log, logging.WARNING, "picker.peer_refused", reason=str(exc))
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"confgen picker peers: {exc}")
                if batch.replica == self.replica:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"confgen picker peers: {SELF}")
                applied = self._store.add_placements(batch.picks)
                self._loads.set(stream, batch.in_flight, batch.replica)
                if expiry is not None:
                    expiry.cancel()
                expiry = self._loads.expire_after()
                if self._on_batch is not None:
                    self._on_batch(applied, len(batch.picks) - applied)
        finally:
            if expiry is not None:
                expiry.cancel()
            self.streams -= 1
            self._loads.drop(stream)
        return b""

    async def _is_replica(self, context: grpc.aio.ServicerContext[bytes, bytes]) -> bool:
        """Whether the caller's certificate is this sidecar's own (read again per stream: renewals)."""
        assert self._own_cert is not None
        presented = list((context.auth_context() or {}).get("x509_pem_cert") or [b""])
        try:
            own = await asyncio.to_thread(self._own_cert.read_bytes)
        except OSError:
            return False
        return _leaf(presented[0]) == _leaf(own) != b""

    def add_to(self, server: grpc.aio.Server) -> None:
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Share": grpc.stream_unary_rpc_method_handler(self.share),  # bytes in, bytes out
        })
        server.add_generic_rpc_handlers((handler,))


@dataclass(frozen=True, slots=True)
class PeerLimits:
    flush_s: float = 0.01  # a batch this often (in-flight counts: at most this stale, plus the transport)
    stale_s: float = 1.0  # a peer's in-flight counts expire after this long without a batch
    max_pending: int = 10_000  # placements queued per peer while its stream is down or slow
    max_batch: int = 512
    connect_timeout_s: float = 2.0
    backoff_s: tuple[float, float] = (0.1, 5.0)  # reconnect delay: first, at most (doubling)
    resolve_s: float = 5.0  # a dns: target is resolved again this often
    resolve_timeout_s: float = 2.0  # a lookup that takes longer keeps the links as they are
    max_peers: int = 64  # addresses of one dns: target dialed at most (each costs a stream every flush_s)


@dataclass(slots=True)
class _Link:
    target: str
    source: str | None = None  # the dns: target it comes from (None: named by --picker-peer itself)
    server_name: str | None = None  # over mTLS: the name the peer's certificate is checked against
    pending: deque[tuple[str, str, Sequence[int]]] = field(default_factory=deque)
    dropped: int = 0
    connected: bool = False
    error: str | None = None
    itself: bool = False  # the target is this replica: stopped, never a problem


class PeerLinks:
    """The sending side: one stream to each peer target, fed by `placed` (called on every pick)."""

    def __init__(self, targets: Sequence[str], store: Datastore, *, tls: TlsFiles | None = None,
                 limits: PeerLimits | None = None, on_sent: Callable[[int], None] | None = None,
                 on_dropped: Callable[[], None] | None = None, replica: str | None = None,
                 resolver: Resolver = resolve) -> None:
        self.replica = replica or secrets.token_hex(8)
        self.limits = limits or PeerLimits()
        self._names = [(t, named) for t in targets if (named := split_dns(t)) is not None]
        self._links = {t: _Link(t) for t in targets if split_dns(t) is None}
        self._lookups: dict[str, str | None] = {t: "not resolved yet" for t, _ in self._names}  # source -> error
        self._resolver = resolver
        self._store = store
        self._tls = tls
        self._on_sent = on_sent
        self._on_dropped = on_dropped
        self._tasks: dict[str, asyncio.Task[None]] = {}  # a link's target, or a dns: source's -> its task

    def connected(self) -> int:
        return sum(1 for ln in self._links.values() if ln.connected)

    def placed(self, pool: str, address: str, hashes: Sequence[int]) -> None:
        for link in self._links.values():
            if link.itself:
                continue
            if len(link.pending) >= self.limits.max_pending:
                link.pending.popleft()
                link.dropped += 1
                if self._on_dropped is not None:
                    self._on_dropped()
            link.pending.append((pool, address, hashes))

    def status(self) -> list[dict[str, Any]]:
        return [{"target": ln.target, "source": ln.source, "connected": ln.connected, "queued": len(ln.pending),
                 "dropped": ln.dropped, "error": ln.error, "itself": ln.itself} for ln in self._links.values()]

    def problems(self) -> list[str]:
        return [*(f"picker peer {ln.target}: not connected ({ln.error or 'connecting'})"
                  for ln in self._links.values() if not ln.connected and not ln.itself),
                *(f"picker peers {source}: {error}" for source, error in self._lookups.items() if error)]

    async def start(self) -> None:
        for link in self._links.values():
            self._dial(link)
        for source, (host, port) in self._names:
            self._tasks[source] = asyncio.create_task(self._follow(source, host, port), name=f"picker-peers {source}")

    async def close(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _dial(self, link: _Link) -> None:
        self._tasks[link.target] = asyncio.create_task(self._run(link), name=f"picker-peer {link.target}")

    async def _follow(self, source: str, host: str, port: int) -> None:
        """Resolve `host` every `resolve_s` and keep one link per address it answers (`_reconcile`)."""
        limits = self.limits
        while True:
            try:
                async with asyncio.timeout(limits.resolve_timeout_s):  # not wait_for: it can swallow a cancel (3.11)
                    found = await self._resolver(host, port)
            except (OSError, TimeoutError, ValueError) as exc:  # gaierror is an OSError; a bad IDNA name a ValueError
                error = f"lookup failed ({type(exc).__name__}: {exc}); its links kept"
                if self._lookups.get(source) != error:
                    log_event(_log, logging.WARNING, "picker.peers_lookup_failed", source=source, error=str(exc))
                self._lookups[source] = error
            else:
                self._lookups[source] = None if found else "resolves to no address"
                self._reconcile(source, host, port, found)
            await asyncio.sleep(limits.resolve_s)

    def _reconcile(self, source: str, host: str, port: int, found: Collection[str]) -> None:
        """One link per address of `found` (at most `max_peers`): new ones dialed, gone ones closed."""
        addresses = sorted(found)
        if len(addresses) > self.limits.max_peers:
            log_event(_log, logging.WARNING, "picker.peers_capped", source=source, found=len(addresses),
                      dialed=self.limits.max_peers)
            addresses = addresses[: self.limits.max_peers]
        wanted = {join_address(a, port) for a in addresses}
        for target in [t for t, ln in self._links.items() if ln.source == source and t not in wanted]:
            del self._links[target]
            task = self._tasks.pop(target, None)
            if task is not None:
                task.cancel()
            log_event(_log, logging.INFO, "picker.peer_gone", source=source, target=target)
        for target in sorted(wanted - self._links.keys()):
            link = self._links[target] = _Link(target, source=source, server_name=host)
            self._dial(link)

    async def _channel(self, link: _Link) -> grpc.aio.Channel:
        target = link.target
        options: list[tuple[str, str | int]] = [
            ("grpc.max_send_message_length", MAX_BATCH_BYTES), ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000)]
        if self._tls is None:
            return grpc.aio.insecure_channel(target, options=options)
        if link.server_name is not None:  # dialed by address: the certificate names the DNS name
            options.append(("grpc.ssl_target_name_override", link.server_name))
        # re-read at every connection (cert-manager renews them in place), off the event loop
        files = self._tls
        ca, key, cert = await asyncio.to_thread(_read_all, (files.client_ca, files.key, files.cert))
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        return grpc.aio.secure_channel(target, creds, options=options)

    async def _run(self, link: _Link) -> None:
        limits = self.limits
        delay = limits.backoff_s[0]
        while True:
            started = time.monotonic()
            try:
                async with await self._channel(link) as channel:
                    async with asyncio.timeout(limits.connect_timeout_s):  # not wait_for (see _follow)
                        await channel.channel_ready()
                    link.connected, link.error = True, None
                    log_event(_log, logging.INFO, "picker.peer_connected", target=link.target)
                    call: grpc.aio.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(METHOD)
                    await call(self._batches(link))
            except (grpc.aio.AioRpcError, TimeoutError, OSError, ValueError) as exc:
                link.error = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
                link.itself = (isinstance(exc, grpc.aio.AioRpcError)
                               and exc.code() == grpc.StatusCode.FAILED_PRECONDITION and SELF in (exc.details() or ""))
            finally:
                if link.connected and not link.itself:
                    log_event(_log, logging.WARNING, "picker.peer_lost", target=link.target, error=link.error)
                link.connected = False
            if link.itself:
                link.pending.clear()
                log_event(_log, logging.INFO, "picker.peer_is_self", target=link.target)
                return
            if time.monotonic() - started > limits.backoff_s[1]:
                delay = limits.backoff_s[0]  # it held a while: start the backoff again
            await asyncio.sleep(delay)
            delay = min(limits.backoff_s[1], delay * 2)

    async def _batches(self, link: _Link) -> AsyncIterator[bytes]:
        limits = self.limits
        while True:
            n = min(len(link.pending), limits.max_batch)
            picks = [link.pending.popleft() for _ in range(n)]
            if n and self._on_sent is not None:
                self._on_sent(n)
            yield encode(self.replica, picks, self._store.own_in_flight())
            await asyncio.sleep(limits.flush_s if not link.pending else 0)


def _read_all(paths: Sequence[Path]) -> list[bytes]:
    return [Path(p).read_bytes() for p in paths]


def _leaf(pem: bytes) -> bytes:
    """The first certificate of a PEM chain, whitespace removed (b"" when there is none)."""
    begin, end = b"-----BEGIN CERTIFICATE-----", b"-----END CERTIFICATE-----"
    start = pem.find(begin)
    stop = pem.find(end, start + 1)
    if start < 0 or stop < 0:
        return b""
    return b"".join(pem[start:stop + len(end)].split())
