"""DNS resolution of worker names (sidecar.observe.resolve). A fake getaddrinfo injects the
answers and failures a real resolver cannot be made to give on a test machine."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from typing import Any

import pytest

from sidecar.observe.resolve import MAX_ADDRESSES, Resolver, prefer_ipv4


class FakeDns:
    """Answers from a table; a host mapped to an exception raises it; counts lookups."""

    def __init__(self) -> None:
        self.table: dict[str, list[str] | BaseException] = {}
        self.calls: list[tuple[str, int]] = []
        self.delay_s = 0.0

    async def __call__(self, host: str, port: int, **_: Any) -> Sequence[tuple[Any, ...]]:
        self.calls.append((host, port))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        answer = self.table[host]
        if isinstance(answer, BaseException):
            raise answer
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
                for ip in answer]


def run(resolver: Resolver, host: str, port: int = 8000) -> tuple[str, ...]:
    return asyncio.run(resolver.resolve(host, port))


def test_ip_literals_pass_through_without_a_lookup() -> None:
    """An IP worker is its own answer: no DNS query is made."""
    dns = FakeDns()
    resolver = Resolver(1.0, dns)
    assert run(resolver, "10.0.0.7") == ("10.0.0.7",)
    assert run(resolver, "::1") == ("::1",)
    assert dns.calls == []


def test_every_address_becomes_an_endpoint_sorted_and_unique() -> None:
    """A name with several IPv4 addresses (a headless Service) yields each once, sorted."""
    dns = FakeDns()
    dns.table["workers.svc"] = ["10.0.0.9", "10.0.0.2", "10.0.0.9", "10.0.0.10"]
    assert run(Resolver(1.0, dns), "workers.svc") == ("10.0.0.10", "10.0.0.2", "10.0.0.9")


def test_a_name_answering_thousands_of_addresses_gives_at_most_max_addresses() -> None:
    """Found by review: one lookup answering 65,000 addresses made 65,000 probed endpoints, each with the
    pool's whole capacity, and a log line listing them all. At most MAX_ADDRESSES, said once."""
    dns = FakeDns()
    dns.table["huge.svc"] = [f"10.{i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(65_000)]
    resolver = Resolver(1.0, dns)
    first = run(resolver, "huge.svc")
    assert len(first) == MAX_ADDRESSES and run(resolver, "huge.svc") == first


def test_ipv4_preferred_over_ipv6_like_envoy() -> None:
    """A dual-stack answer keeps only its IPv4 addresses; an IPv6-only one keeps IPv6."""
    dns = FakeDns()
    dns.table["localhost"] = ["::1", "127.0.0.1"]
    dns.table["v6only"] = ["fd00::2", "fd00::1"]
    resolver = Resolver(1.0, dns)
    assert run(resolver, "localhost") == ("127.0.0.1",)
    assert run(resolver, "v6only") == ("fd00::1", "fd00::2")
    assert prefer_ipv4(set()) == ()


@pytest.mark.parametrize("failure", [
    socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
    socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
    OSError("resolver crashed"),
])
def test_failed_lookup_keeps_the_last_good_answer(failure: BaseException) -> None:
    """After a good answer, a failing lookup returns that answer (a DNS outage never
    empties a pool); before any good answer it returns ()."""
    dns = FakeDns()
    resolver = Resolver(1.0, dns)
    dns.table["w"] = failure
    assert run(resolver, "w") == ()
    dns.table["w"] = ["10.0.0.1", "10.0.0.2"]
    assert run(resolver, "w") == ("10.0.0.1", "10.0.0.2")
    dns.table["w"] = failure
    assert run(resolver, "w") == ("10.0.0.1", "10.0.0.2")
    dns.table["w"] = ["10.0.0.3"]
    assert run(resolver, "w") == ("10.0.0.3",)


def test_slow_lookup_times_out_and_keeps_the_last_good_answer() -> None:
    """A lookup slower than the timeout is abandoned like a failure."""
    dns = FakeDns()
    resolver = Resolver(0.05, dns)
    dns.table["w"] = ["10.0.0.1"]
    assert run(resolver, "w") == ("10.0.0.1",)
    dns.delay_s = 5.0
    assert run(resolver, "w") == ("10.0.0.1",)


def test_an_answer_without_ip_addresses_counts_as_no_answer() -> None:
    """Entries that are not IP literals are dropped; nothing left keeps the last good."""
    dns = FakeDns()
    resolver = Resolver(1.0, dns)
    dns.table["w"] = ["10.0.0.1"]
    run(resolver, "w")
    dns.table["w"] = ["not-an-ip"]
    assert run(resolver, "w") == ("10.0.0.1",)


def test_forgotten_hosts_lose_their_last_good_answer() -> None:
    """A host that left the topology is forgotten: if it comes back, a failure gives ()."""
    dns = FakeDns()
    resolver = Resolver(1.0, dns)
    dns.table["w"] = ["10.0.0.1"]
    dns.table["v"] = ["10.0.0.2"]
    run(resolver, "w")
    run(resolver, "v")
    resolver.forget_except({("v", 8000)})
    dns.table["w"] = dns.table["v"] = socket.gaierror(socket.EAI_AGAIN, "down")
    assert run(resolver, "w") == ()
    assert run(resolver, "v") == ("10.0.0.2",)


def test_the_default_lookup_is_the_loops_real_resolver() -> None:
    """Without an injected lookup the loop's getaddrinfo answers: localhost is 127.0.0.1."""
    assert run(Resolver(2.0), "localhost") == ("127.0.0.1",)
