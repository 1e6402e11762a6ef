"""Workers found on the bus (kvbus.service.discovery): an advertised URL is network
input, taken only when plain and within the allow-list; a configured worker never
changes; the found ones are bounded."""

from __future__ import annotations

import socket

import pytest

from kvbus.service import discovery
from kvbus.service.discovery import AllowedHosts, WorkerDiscovery, plain_url

LOOPBACK = AllowedHosts(discovery.DEFAULT_HOSTS)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://10.1.2.3:8000", "not in --discover-hosts"),
        ("http://evil.example:8000", "not in --discover-hosts"),
        ("http://127.0.0.1.evil.example:80", "not in --discover-hosts"),
        ("ftp://127.0.0.1:8000", "not http(s)"),
        ("127.0.0.1:8000", "not http(s)"),
        ("http://user:secret@127.0.0.1:8000", "credentials"),
        ("http://127.0.0.1:8000/v1", "a path, query or fragment"),
        ("http://127.0.0.1:8000/?next=http://evil", "a path, query or fragment"),
        ("http://127.0.0.1:" + "9" * 3000, "longer than"),
        ("http://[::1", "not a URL"),
        ("http://localhost.:8000", "ending in a dot"),
        ("http://127.0.0.1.:8000", "ending in a dot"),
    ],
)
def test_an_advertised_url_that_is_not_plain_or_not_allowed_is_refused(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        plain_url(url, LOOPBACK)


def test_allowed_hosts_are_networks_names_and_name_suffixes() -> None:
    allowed = AllowedHosts(["10.0.0.0/8", "fd00::/8", "vllm-0.vllm", ".engines.svc"])
    assert plain_url("http://10.9.8.7:8000/", allowed) == "http://10.9.8.7:8000"
    assert plain_url("https://[fd00::5]:443", allowed) == "https://[fd00::5]"
    assert plain_url("http://VLLM-0.vllm:8000", allowed) == "http://vllm-0.vllm:8000"
    assert plain_url("http://a.engines.svc:8000", allowed) == "http://a.engines.svc:8000"
    for host in ("11.0.0.1", "vllm-1.vllm", "engines.svc", "x.engines.svc.evil"):
        with pytest.raises(ValueError, match="not in --discover-hosts"):
            plain_url(f"http://{host}:8000", allowed)
    assert plain_url("http://localhost:8000", LOOPBACK) == "http://localhost:8000"
    assert plain_url("http://[::1]:8000", LOOPBACK) == "http://[::1]:8000"
    here = socket.gethostname()  # what vllm serve without --host advertises
    assert plain_url(f"http://{here}:8000", LOOPBACK) == f"http://{here.lower()}:8000"


def test_found_workers_join_the_map_move_and_never_replace_a_configured_one() -> None:
    workers = {"static": "http://127.0.0.1:9000"}
    moved: list[str] = []
    live: set[str] = set()
    found = WorkerDiscovery(workers, LOOPBACK, moved.append, live.__contains__)
    assert found.offer("static", "http://127.0.0.1:1")  # configured: taken as it is
    assert workers["static"] == "http://127.0.0.1:9000"
    assert found.offer("e0/dp1", "http://127.0.0.1:8001/")
    assert workers["e0"] == "http://127.0.0.1:8001" and moved == []
    live.add("e0")  # while it gets traffic, a record naming another URL is refused
    assert found.offer("e0/dp0", "http://127.0.0.1:8002") and moved == []
    assert workers["e0"] == "http://127.0.0.1:8001"
    live.clear()  # stopped or stale: it may come back elsewhere
    assert found.offer("e0/dp0", "http://127.0.0.1:8002") and moved == ["e0"]
    assert workers["e0"] == "http://127.0.0.1:8002"
    # A later bad record does not undo a good one; a new source with one is not taken.
    assert found.offer("e0", "http://10.0.0.1:8000") and workers["e0"] == "http://127.0.0.1:8002"
    assert not found.offer("e1", "http://10.0.0.1:8000") and "e1" not in workers
    assert not found.offer("\x1b[2J", "http://127.0.0.1:8003")
    assert not found.offer("n" * 300, "http://127.0.0.1:8003")
    assert found.refused == 5


def test_the_workers_found_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "MAX_DISCOVERED", 3)
    workers: dict[str, str] = {}
    found = WorkerDiscovery(workers, LOOPBACK, lambda _: None, lambda _: False)
    assert all(found.offer(f"e{n}", f"http://127.0.0.1:{8000 + n}") for n in range(3))
    assert not found.offer("e3", "http://127.0.0.1:8003")
    assert found.offer("e0", "http://127.0.0.1:9000")  # one already found may move
    assert sorted(workers) == ["e0", "e1", "e2"] and found.refused == 1
    # kv events are indexed for the found and for as many others, no more.
    assert all(found.indexes(f"e{n}") for n in range(3))
    assert [found.indexes(f"x{n}") for n in range(4)] == [True, True, True, False]


def test_an_engine_advertises_vllms_own_address_or_the_one_it_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvbus.connectors.vllm_stats import advertised_url

    monkeypatch.delenv("KVBUS_ADVERTISE_URL", raising=False)
    serve = ["serve", "m", "--host", "127.0.0.1", "--port", "8123"]
    assert advertised_url(serve) == "http://127.0.0.1:8123"
    assert advertised_url(["--model", "m", "--host", "::1", "--port", "9"]) == "http://[::1]:9"
    hostname = socket.gethostname()
    assert advertised_url(["serve", "m"]) == f"http://{hostname}:8000"  # vLLM's defaults
    assert advertised_url(["serve", "m", "--host", "0.0.0.0"]) == f"http://{hostname}:8000"
    assert advertised_url(["-m", "pytest"]) == ""  # not an API server
    assert advertised_url(["serve", "--port", "x"]) == ""
    monkeypatch.setenv("KVBUS_ADVERTISE_URL", "http://10.1.2.3:8000/")
    assert advertised_url(serve) == "http://10.1.2.3:8000"
