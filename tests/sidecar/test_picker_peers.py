"""Picker replicas sharing placements and in-flight counts (sidecar/outputs/picker/peers.py):
the batch format and its caps, the datastore's view of the peers' load, and two stores linked
over a real grpc.aio server on a Unix socket (events, no sleeps)."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path

import grpc
import pytest

from sidecar.outputs.grpc import GrpcServer, GrpcSettings
from sidecar.outputs.picker.datastore import Datastore, EndpointFacts, PoolFacts
from sidecar.outputs.picker.peers import (
    MAX_HASHES,
    METHOD,
    BatchError,
    PeerLimits,
    PeerLinks,
    PeerLoads,
    PeerServicer,
    decode,
    encode,
)
from sidecar.outputs.picker.scheduling import Picker, PickRequest, load_of


def _store() -> Datastore:
    store = Datastore()
    store.update([PoolFacts("chat", ("m",), tuple(EndpointFacts(address=a, serving=True, capacity=8)
                                                   for a in ("10.0.0.1:8000", "10.0.0.2:8000")))])
    return store


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_batch_round_trips_and_every_broken_one_is_refused() -> None:
    data = encode("r1", [("chat", "10.0.0.1:8000", [1, 2, 2**64 - 1])], {"chat": {"10.0.0.1:8000": 3}})
    batch = decode(data)
    assert batch.replica == "r1" and batch.picks == (("chat", "10.0.0.1:8000", (1, 2, 2**64 - 1)),)
    assert batch.in_flight == {"chat": {"10.0.0.1:8000": 3}}
    bad = [
        b"not json",
        b"[" * 100_000,
        json.dumps({"v": 2}).encode(),
        json.dumps({"v": 1, "replica": "r", "picks": {"a": 1}}).encode(),
        json.dumps({"v": 1, "replica": "r", "picks": [["chat", "a", [2**64]]]}).encode(),  # beyond 64 bits
        json.dumps({"v": 1, "replica": "r", "picks": [["chat", "a", [-1]]]}).encode(),
        json.dumps({"v": 1, "replica": "r", "picks": [["chat", "a", [1.5]]]}).encode(),
        json.dumps({"v": 1, "replica": "r", "picks": [["chat", "a", [True]]]}).encode(),
        json.dumps({"v": 1, "replica": "r", "picks": [["chat", "a", list(range(MAX_HASHES + 1))]]}).encode(),
        json.dumps({"v": 1, "replica": "r", "picks": [["chat", "a"]]}).encode(),
        json.dumps({"v": 1, "replica": "r", "in_flight": {"chat": {"a": -1}}}).encode(),
        json.dumps({"v": 1, "replica": "r", "in_flight": {"chat": {"a": 10**7}}}).encode(),
        json.dumps({"v": 1, "replica": "r", "in_flight": {"chat": [1]}}).encode(),
        b" " * (1024 * 1024 + 1),
        json.dumps({"v": 1, "picks": []}).encode(),  # no replica
        json.dumps({"v": 1, "replica": "x" * 65}).encode(),
    ]
    for raw in bad:
        with pytest.raises(BatchError):
            decode(raw)


def test_placements_fill_the_index_unknown_endpoints_are_skipped() -> None:
    store = _store()
    applied = store.add_placements([("chat", "10.0.0.2:8000", (7, 8, 9)), ("chat", "10.9.9.9:1", (1,)),
                                    ("other", "10.0.0.1:8000", (1,))])
    assert applied == 1
    a, b = store.endpoints("chat")
    assert b.index.match([7, 8, 9]) == 3 and a.index.match([7]) == 0


def test_a_follow_up_through_the_other_replica_goes_where_its_history_is() -> None:
    """Replica A sent a conversation's first turn to the endpoint that is NOT its rendezvous home;
    replica B, told of the placement, sends the follow-up there too (untold, it presumes the home)."""
    from sidecar.outputs.picker.prompt import block_hashes, parse_body

    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    first = [system, {"role": "user", "content": "the first question, at some length " * 4}]
    follow = [*first, {"role": "assistant", "content": "an answer " * 10}, {"role": "user", "content": "and then?"}]
    p1, p2 = (parse_body(json.dumps({"model": "m", "messages": m, "max_tokens": 16}).encode()) for m in (first, follow))
    assert p1 is not None and p2 is not None
    h1, h2 = block_hashes(p1.text, "m"), block_hashes(p2.text, "m")

    def facts(store: Datastore) -> None:
        store.update([PoolFacts("chat", ("m",), tuple(
            EndpointFacts(address=a, serving=True, capacity=8, token_latency_s=0.02)
            for a in ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")))])

    told, untold = Datastore(), Datastore()
    facts(told)
    facts(untold)
    picker = Picker()
    home = picker.pick(PickRequest("chat", p2, h2), untold.endpoints("chat")).endpoints[0].address
    elsewhere = next(a for a in ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000") if a != home)
    told.add_placements([("chat", elsewhere, tuple(h1))])
    assert picker.pick(PickRequest("chat", p2, h2), told.endpoints("chat")).endpoints[0].address == elsewhere


def test_peer_loads_count_until_replaced_dropped_or_stale() -> None:
    store, clock = _store(), _Clock()
    loads = PeerLoads(store, clock, stale_s=1.0)
    a, b = store.endpoints("chat")
    loads.set(1, {"chat": {a.address: 3}})
    loads.set(2, {"chat": {a.address: 2, b.address: 1}})
    assert (a.peers, b.peers, load_of(a)) == (5.0, 1.0, 5.0)
    loads.set(1, {})  # its requests ended: the whole map is replaced
    assert (a.peers, b.peers) == (2.0, 1.0)
    loads.drop(2)  # its stream ended
    assert (a.peers, b.peers) == (0.0, 0.0)
    loads.set(3, {"chat": {b.address: 4}})
    clock.t += 1.5
    loads.apply()  # silent past stale_s: counts for nothing
    assert b.peers == 0.0
    # the engine's count less the peers' is what bypasses every picker
    store.update([PoolFacts("chat", ("m",), (EndpointFacts(address=a.address, serving=True, capacity=8, running=6),
                                             EndpointFacts(address=b.address, serving=True, capacity=8)))])
    loads.set(4, {"chat": {a.address: 4}})
    store.update([PoolFacts("chat", ("m",), (EndpointFacts(address=a.address, serving=True, capacity=8, running=6),
                                             EndpointFacts(address=b.address, serving=True, capacity=8)))])
    assert (a.peers, a.bypass, load_of(a)) == (4.0, 2.0, 6.0)


def test_one_replica_over_two_links_counts_once_and_its_last_batch_wins() -> None:
    """A dual-stack name (an A and an AAAA record) or one peer listed twice: two links to one replica,
    each carrying its whole map. Counted once, by the replica the batches name."""
    store, clock = _store(), _Clock()
    loads = PeerLoads(store, clock, stale_s=1.0)
    a, b = store.endpoints("chat")
    loads.set(1, {"chat": {a.address: 3}}, "r1")
    loads.set(2, {"chat": {a.address: 3}}, "r1")  # the same replica's map over its second link
    assert a.peers == 3.0
    loads.set(1, {"chat": {a.address: 1, b.address: 1}}, "r1")
    assert (a.peers, b.peers) == (1.0, 1.0)
    loads.set(3, {"chat": {a.address: 2}}, "r2")  # another replica adds its own
    assert a.peers == 3.0
    loads.drop(2)  # a link that no longer carries r1's latest map: nothing changes
    assert (a.peers, b.peers) == (3.0, 1.0)
    loads.drop(1)  # the link r1's latest map came on: gone until its next batch on another link
    assert (a.peers, b.peers) == (2.0, 0.0)


class _FakeTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when the test says (the expiry timers use it)."""

    now = 1000.0

    def time(self) -> float:
        return self.now


class _SilentContext:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")


def test_a_peer_that_goes_silent_with_its_stream_open_counts_for_nothing_after_stale_s() -> None:
    """A frozen or partitioned replica's stream can stay open for the transport's keepalive (~40 s);
    its counts must not: they expire stale_s after its last batch, with no other batch to trigger it."""
    loop = _FakeTimeLoop()
    store = _store()
    loads = PeerLoads(store, loop.time, stale_s=1.0)
    servicer = PeerServicer(store, loads, replica="me")
    a, _ = store.endpoints("chat")
    resume = asyncio.Event()

    async def batches():  # type: ignore[no-untyped-def]
        yield encode("r1", [], {"chat": {a.address: 4}})
        await resume.wait()  # silent, the stream still open
        yield encode("r1", [], {"chat": {a.address: 1}})

    async def main() -> None:
        task = asyncio.ensure_future(servicer.share(batches(), _SilentContext()))  # type: ignore[arg-type]
        for _ in range(5):
            await asyncio.sleep(0)
        assert a.peers == 4.0
        loop.now += 0.9  # within stale_s: still counted
        for _ in range(5):
            await asyncio.sleep(0)
        assert a.peers == 4.0
        loop.now += 0.2  # past it
        for _ in range(5):
            await asyncio.sleep(0)
        assert a.peers == 0.0 and servicer.streams == 1  # expired, the stream itself untouched
        resume.set()  # it speaks again: counted again
        await asyncio.wait_for(task, 5)
        assert servicer.streams == 0 and a.peers == 0.0  # its stream ended

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def _short_socket_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="cg-peer-"))  # 0700, short enough for a socket path
    os.chmod(path, 0o700)
    return path


def test_two_replicas_share_placements_and_loads_over_a_unix_socket() -> None:
    asyncio.run(_share())


async def _share() -> None:
    receiver, sender = _store(), _store()
    got = asyncio.Event()
    batches: list[tuple[int, int]] = []

    def on_batch(applied: int, skipped: int) -> None:
        batches.append((applied, skipped))
        if applied:
            got.set()

    clock = _Clock()
    ended = asyncio.Event()

    class Loads(PeerLoads):
        def drop(self, stream: int) -> None:
            super().drop(stream)
            ended.set()

    servicer = PeerServicer(receiver, Loads(receiver, clock, stale_s=60.0), on_batch, replica="receiver")
    sock = _short_socket_dir() / "grpc.sock"
    server = GrpcServer(GrpcSettings(socket=sock))
    server.add(servicer.add_to, "peers")
    await server.start()
    links = PeerLinks([f"unix:{sock}"], sender, limits=PeerLimits(flush_s=0.005))
    try:
        a, _ = sender.endpoints("chat")
        a.in_flight = 2
        links.placed("chat", a.address, [11, 12, 13])
        await links.start()
        await asyncio.wait_for(got.wait(), 10)
        ra, rb = receiver.endpoints("chat")
        assert ra.index.match([11, 12, 13]) == 3 and rb.index.match([11]) == 0
        assert ra.peers == 2.0 and ra.in_flight == 0  # the peer's load, not ours
        assert links.connected() == 1 and links.problems() == []
    finally:
        await links.close()
        await server.stop(0)
    # the stream ended: the peer's requests no longer count here
    await asyncio.wait_for(ended.wait(), 10)
    assert servicer.streams == 0 and receiver.endpoints("chat")[0].peers == 0.0


def test_a_broken_batch_ends_the_peer_stream_with_invalid_argument() -> None:
    asyncio.run(_broken())


async def _broken() -> None:
    receiver = _store()
    servicer = PeerServicer(receiver, PeerLoads(receiver, _Clock(), stale_s=60.0))
    sock = _short_socket_dir() / "grpc.sock"
    server = GrpcServer(GrpcSettings(socket=sock))
    server.add(servicer.add_to, "peers")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix:{sock}") as channel:
            call = channel.stream_unary(METHOD)

            async def one() -> object:
                yield json.dumps({"v": 1, "replica": "r", "picks": [["chat", "10.0.0.1:8000", [2**70]]]}).encode()

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(one(), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await server.stop(0)
    assert all(e.index.match([1]) == 0 for e in receiver.endpoints("chat"))


def test_an_unreachable_peer_is_a_problem_and_its_queue_is_bounded() -> None:
    dropped: list[int] = []
    links = PeerLinks(["unix:/nonexistent/grpc.sock"], _store(), limits=PeerLimits(max_pending=3),
                      on_dropped=lambda: dropped.append(1))
    for i in range(5):
        links.placed("chat", "10.0.0.1:8000", [i])
    (status,) = links.status()
    assert status["queued"] == 3 and status["dropped"] == 2 and len(dropped) == 2
    assert links.problems() == ["picker peer unix:/nonexistent/grpc.sock: not connected (connecting)"]


def test_peers_over_mutual_tls_and_a_stranger_is_refused_at_the_handshake(tmp_path: Path) -> None:
    """HOST:PORT peers: the sender presents the sidecar's own certificate (the CA of --grpc-client-ca
    signs it) and verifies the peer's against that CA; a certificate of another CA gets nowhere."""
    from sidecar.config.tls import TlsFiles
    from tests.support.certs import CertAuthority

    ca = CertAuthority.create(tmp_path / "ca")
    own = ca.issue("sidecar", ["IP:127.0.0.1"])
    files = TlsFiles(own.cert, own.key, ca.cert)
    stranger_ca = CertAuthority.create(tmp_path / "other", name="other-ca")
    stranger = stranger_ca.issue("sidecar", ["IP:127.0.0.1"])
    envoy = ca.issue("envoy", ["DNS:envoy"])  # signed by the same CA: may call the picker, not share
    asyncio.run(_over_mtls(files, TlsFiles(stranger.cert, stranger.key, stranger_ca.cert),
                           TlsFiles(envoy.cert, envoy.key, ca.cert)))


async def _over_mtls(files: object, stranger: object, envoy: object) -> None:
    from sidecar.config.tls import TlsFiles

    assert isinstance(files, TlsFiles) and isinstance(stranger, TlsFiles) and isinstance(envoy, TlsFiles)
    receiver = _store()
    got = asyncio.Event()

    def on_batch(applied: int, skipped: int) -> None:
        if applied:
            got.set()

    refused = asyncio.Event()

    class Servicer(PeerServicer):
        async def _is_replica(self, context: grpc.aio.ServicerContext[bytes, bytes]) -> bool:
            ok = await super()._is_replica(context)
            if not ok:
                refused.set()
            return ok

    servicer = Servicer(receiver, PeerLoads(receiver, _Clock(), stale_s=60.0), on_batch, own_cert=files.cert)
    server = GrpcServer(GrpcSettings("127.0.0.1", 0, tls=files))
    server.add(servicer.add_to, "peers")
    port = await server.start()
    fast = PeerLimits(flush_s=0.005, connect_timeout_s=1.0, backoff_s=(0.05, 0.2))
    bad = PeerLinks([f"127.0.0.1:{port}"], _store(), tls=stranger, limits=fast)
    good = PeerLinks([f"127.0.0.1:{port}"], _store(), tls=files, limits=fast)
    impostor = PeerLinks([f"127.0.0.1:{port}"], _store(), tls=envoy, limits=fast)
    try:
        bad.placed("chat", "10.0.0.2:8000", [41])
        await bad.start()
        impostor.placed("chat", "10.0.0.2:8000", [51])
        a, _ = impostor._store.endpoints("chat")
        a.in_flight = 9
        await impostor.start()
        good.placed("chat", "10.0.0.1:8000", [31, 32])
        await good.start()
        await asyncio.wait_for(got.wait(), 10)
        ra, rb = receiver.endpoints("chat")
        assert ra.index.match([31, 32]) == 2
        assert rb.index.match([41]) == 0 and bad.connected() == 0  # the stranger never got a stream
        assert bad.problems() and good.problems() == []
        # the Envoy's certificate: connected (the CA signs it), refused at the stream, nothing moved
        await asyncio.wait_for(refused.wait(), 10)
        assert rb.index.match([51]) == 0 and ra.peers == 0.0
    finally:
        await impostor.close()
        await bad.close()
        await good.close()
        await server.stop(0)


def test_a_link_to_the_replica_itself_stops_and_counts_nothing_twice() -> None:
    """A peer list naming this replica (the Kubernetes control plane's pods all get the same list):
    the stream is refused with FAILED_PRECONDITION, the link stops for good and is no problem."""
    asyncio.run(_itself())


async def _itself() -> None:
    store = _store()
    links = PeerLinks([], store, replica="me")  # only for its id
    servicer = PeerServicer(store, PeerLoads(store, _Clock(), stale_s=60.0), replica=links.replica)
    sock = _short_socket_dir() / "grpc.sock"
    server = GrpcServer(GrpcSettings(socket=sock))
    server.add(servicer.add_to, "peers")
    await server.start()
    self_link = PeerLinks([f"unix:{sock}"], store, replica="me", limits=PeerLimits(flush_s=0.005))
    a, _ = store.endpoints("chat")
    a.in_flight = 4
    try:
        self_link.placed("chat", a.address, [5])
        await self_link.start()
        await asyncio.wait_for(asyncio.gather(*self_link._tasks.values()), 10)  # the link's task ends by itself
        (status,) = self_link.status()
        assert status["itself"] and status["queued"] == 0 and self_link.problems() == []
        assert a.peers == 0.0  # its own in-flight requests were not counted again as a peer's
        self_link.placed("chat", a.address, [6])
        assert self_link.status()[0]["queued"] == 0
    finally:
        await self_link.close()
        await server.stop(0)



def test_dns_peers_follow_the_answer_and_are_checked_against_the_name(tmp_path: Path) -> None:
    """dns:HOST:PORT (the Kubernetes render's headless Service of the proxy pods): a link per address
    HOST resolves to, dialed by address over mutual TLS and checked against HOST (the certificate
    names only the DNS name, no IP); each replica's own address ends as a link to itself; an
    address that leaves the answer is closed; a failed lookup keeps the links and is a problem.
    The only stand-in is the DNS answer (two loopback addresses for one name: this machine's
    resolver has no such record); the servers, links, TLS and streams are the real ones."""
    from sidecar.config.tls import TlsFiles
    from tests.support.certs import CertAuthority

    ca = CertAuthority.create(tmp_path / "ca")
    own = ca.issue("pickers", ["DNS:confgen-x-pickers"])
    asyncio.run(_dns_peers(TlsFiles(own.cert, own.key, ca.cert)))


async def _dns_peers(files: object) -> None:
    import socket

    from confgen.runtime import free_port
    from sidecar.config.tls import TlsFiles

    assert isinstance(files, TlsFiles)
    port = free_port()
    answer: set[str] = {"127.0.0.1", "127.0.0.2"}
    failing = False
    lookups = asyncio.Event()

    async def resolver(host: str, p: int) -> set[str]:
        assert (host, p) == ("confgen-x-pickers", port)
        lookups.set()
        if failing:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return set(answer)

    stores, links, servers, learned, dropped = [], [], [], [], []
    limits = PeerLimits(flush_s=0.005, connect_timeout_s=1.0, backoff_s=(0.05, 0.2), resolve_s=0.02)
    for host in ("127.0.0.1", "127.0.0.2"):
        store = _store()
        got, gone = asyncio.Event(), asyncio.Event()

        class Loads(PeerLoads):
            def drop(self, stream: int, gone: asyncio.Event = gone) -> None:
                super().drop(stream)
                gone.set()

        link = PeerLinks([f"dns:confgen-x-pickers:{port}"], store, tls=files, limits=limits, resolver=resolver)
        servicer = PeerServicer(store, Loads(store, _Clock(), stale_s=60.0),
                                lambda applied, _skipped, got=got: got.set() if applied else None,
                                replica=link.replica, own_cert=files.cert)
        server = GrpcServer(GrpcSettings(host, port, tls=files))
        server.add(servicer.add_to, "peers")
        await server.start()
        stores.append(store)
        links.append(link)
        servers.append(server)
        learned.append(got)
        dropped.append(gone)
    a, b = links

    async def settled(link: PeerLinks) -> list[dict[str, object]]:
        for _ in range(500):  # one address known to be this replica, the other connected
            status = link.status()
            if sorted((bool(s["itself"]), bool(s["connected"])) for s in status) == [(False, True), (True, False)]:
                return status
            await asyncio.sleep(0.01)
        raise AssertionError(link.status())

    try:
        await a.start()
        await b.start()
        for link, mine in ((a, f"127.0.0.1:{port}"), (b, f"127.0.0.2:{port}")):
            status = await settled(link)
            assert {s["target"] for s in status if s["itself"]} == {mine}
            assert all(s["source"] == f"dns:confgen-x-pickers:{port}" for s in status)
            assert link.problems() == [] and link.connected() == 1
        a.placed("chat", "10.0.0.1:8000", [71, 72])
        b.placed("chat", "10.0.0.2:8000", [81])
        await asyncio.wait_for(asyncio.gather(learned[0].wait(), learned[1].wait()), 10)
        assert stores[1].endpoints("chat")[0].index.match([71, 72]) == 2  # b learned a's placement
        assert stores[0].endpoints("chat")[1].index.match([81]) == 1  # and a learned b's
        assert stores[0].endpoints("chat")[0].index.match([71]) == 0  # a's own never came back to it
        # b's pod goes away: a closes its link to b (b counts a's stream gone), b sees itself alone
        answer.discard("127.0.0.2")
        await asyncio.wait_for(dropped[1].wait(), 10)
        for _ in range(500):
            if [s["target"] for s in a.status()] == [f"127.0.0.1:{port}"]:
                break
            await asyncio.sleep(0.01)
        assert [s["target"] for s in a.status()] == [f"127.0.0.1:{port}"] and a.connected() == 0
        # a lookup that fails keeps what is there and says so
        failing = True
        lookups.clear()
        await asyncio.wait_for(lookups.wait(), 10)
        for _ in range(500):
            if a.problems():
                break
            await asyncio.sleep(0.01)
        assert [s["target"] for s in a.status()] == [f"127.0.0.1:{port}"]
        assert a.problems() and "lookup failed" in a.problems()[0] and "kept" in a.problems()[0]
    finally:
        for link in links:
            await link.close()
        for server in servers:
            await server.stop(0)


def test_dns_peers_past_the_cap_are_not_dialed() -> None:
    """An answer larger than max_peers dials the first max_peers addresses (each peer is a stream
    every flush): bounded whatever the DNS says."""
    asyncio.run(_capped())


async def _capped() -> None:
    answered = asyncio.Event()

    async def resolver(host: str, port: int) -> set[str]:
        answered.set()
        return {f"127.0.1.{i}" for i in range(1, 40)}

    links = PeerLinks(["dns:many:9"], _store(), tls=None, resolver=resolver,
                      limits=PeerLimits(max_peers=5, connect_timeout_s=0.2, backoff_s=(0.5, 1.0)))
    try:
        await links.start()
        await asyncio.wait_for(answered.wait(), 10)
        await asyncio.sleep(0)  # the reconcile runs right after the answer, in the same task
        assert len(links.status()) == 5
    finally:
        await links.close()


def test_the_system_resolver_answers_for_a_dns_peer() -> None:
    """The default lookup is the system resolver, off the event loop: localhost answers loopback."""
    from sidecar.outputs.picker.peers import resolve

    assert "127.0.0.1" in asyncio.run(resolve("localhost", 9110))
