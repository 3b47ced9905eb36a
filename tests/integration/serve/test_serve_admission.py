"""`jaxgpt serve`'s admission and clean-up, on the in-process server of tests/test_serve.py: a request is taken whole
or refused whole (a 400 past what the engine ever holds, a 429 past its room now), a front end whose engine drains
slowly queues its messages without blocking its event loop, and a request that ends early (its client gone,
waiting or decoding, streamed or not) leaves nothing behind in the engine."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from helpers.server import Server  # noqa: E402

SLOTS, WAITING = 2, 6


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(slots=SLOTS, max_waiting=WAITING)
    yield s
    s.close()


def held(server: Server) -> int:
    """Requests the engine holds: waiting, or in a slot."""
    return len(server.engine.waiting) + sum(b is not None for b in server.engine.active)


def wait_until(condition: Callable[[], bool], what: str, timeout: float) -> float:
    """Seconds until `condition` holds (an assertion error naming `what` past `timeout`)."""
    t = time.perf_counter()
    while not condition():
        assert time.perf_counter() - t < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.01)
    return time.perf_counter() - t


def gated(monkeypatch: pytest.MonkeyPatch, obj: object, name: str) -> threading.Event:
    """`obj.name` waits for the returned event before running (its thread stalls there until the test sets it)."""
    gate, original = threading.Event(), getattr(obj, name)

    def wait_then(*args: object) -> object:
        gate.wait(60)
        return original(*args)

    monkeypatch.setattr(obj, name, wait_then)
    return gate


def slowed(monkeypatch: pytest.MonkeyPatch, server: Server, seconds: float) -> None:
    """Each decode chunk of the server's engine takes at least `seconds` (a long request spans many ticks)."""
    step = server.engine._step

    def slow() -> None:
        time.sleep(seconds)
        step()

    monkeypatch.setattr(server.engine, "_step", slow)


def test_a_request_past_the_limit_is_a_400_naming_it_and_its_connection_serves_on(server):
    """10,000 prompts (60 KB) is a 400 that names the limit /v1/models reports; nothing reaches the engine, and the
    same keep-alive connection is answered next (today's main: a 500 from a full pipe, then a reset)."""
    capacity = SLOTS + WAITING
    with httpx.Client(base_url=server.url, timeout=60) as client:
        entry = client.get("/models").json()["data"][0]
        assert entry["max_completions_per_request"] == capacity
        for body in ({"prompt": ["ab"] * 10_000}, {"prompt": ["ab"] * 3, "n": 3}, {"prompt": [[1, 2]] * 9}):
            answer = client.post("/completions", json={**body, "max_tokens": 5})
            error = answer.json()["error"]
            assert answer.status_code == 400 and error["type"] == "invalid_request_error", answer.text
            assert f"limit of {capacity} per request" in error["message"]
        assert held(server) == 0
        full = client.post("/completions", json={"prompt": ["ab"] * capacity, "max_tokens": 3, "temperature": 0})
        assert full.status_code == 200 and len(full.json()["choices"]) == capacity
        chat = client.post("/chat/completions", json={"messages": [{"role": "user", "content": "a"}]})
        assert chat.status_code == 400  # (no template) and still the same connection
    assert wait_until(lambda: held(server) == 0, "the engine empty", 2) < 2


def test_a_request_that_does_not_fit_now_is_a_429_and_nothing_of_it_is_queued(server, monkeypatch):
    """With every slot busy and part of the waiting room taken, a request of more choices than the room left is
    refused whole: the engine holds what it held (today's main queued part of it and left it there)."""
    gate = gated(monkeypatch, server.engine, "_step")  # the engine's thread stalls at its first decode chunk
    first = {"prompt": ["ab"] * 6, "max_tokens": 20, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        taken = pool.submit(httpx.post, f"{server.url}/completions", json=first, timeout=60)
        wait_until(lambda: held(server) == 6, "the first request held", 10)
        refused = httpx.post(f"{server.url}/completions", json={"prompt": ["cd"] * 3, "max_tokens": 2}, timeout=60)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error", refused.text
        assert held(server) == 6
        gate.set()
        assert taken.result().status_code == 200
    wait_until(lambda: held(server) == 0, "the engine empty", 2)
    assert httpx.post(f"{server.url}/completions", json={"prompt": ["cd"] * 3, "max_tokens": 2},
                      timeout=60).status_code == 200


def test_a_slow_draining_engine_queues_the_front_ends_messages_without_blocking_it(monkeypatch):
    """The engine's side stops reading (stalled in its first submit) while two requests' submissions (about 300 KB,
    more than the pipe holds) wait to be sent: the front end still answers /health at once, and once the engine
    drains the pipe both requests are answered whole (today's main: a 500 from BlockingIOError)."""
    big = Server(slots=4, max_waiting=600)
    try:
        gate = gated(monkeypatch, big.engine, "submit")
        prompt = [i % 30 + 1 for i in range(60)]
        body = {"prompt": [prompt] * 300, "max_tokens": 1, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(httpx.post, f"{big.url}/completions", json=body, timeout=120) for _ in range(2)]
            time.sleep(1.0)  # both submitted, the first stalled in the engine's side, the rest of the pipe full
            t = time.perf_counter()
            assert httpx.get(f"http://127.0.0.1:{big.port}/health", timeout=5).status_code == 200
            assert time.perf_counter() - t < 1.0
            gate.set()
            for answer in answers:
                got = answer.result()
                assert got.status_code == 200, got.text[:300]
                assert [c["finish_reason"] for c in got.json()["choices"]] == ["length"] * 300
    finally:
        big.close()


def test_clients_that_hang_up_waiting_decoding_or_streaming_leave_nothing_behind(server, monkeypatch):
    """Each chunk takes 0.5 s, so a request of 60 tokens spans 4 s. A client that hangs up while its request waits
    for a slot takes it out of the queue, and one that hangs up while its request decodes (answered whole or
    streamed) frees its slot, each within a tick or two, while the others decode on (today's main left the waiting
    one queued and the whole one decoding to its end)."""
    slowed(monkeypatch, server, 0.5)
    long = {"max_tokens": 60, "temperature": 1.0, "seed": 1}
    with httpx.stream("POST", f"{server.url}/completions", json={**long, "prompt": "ab", "n": 2, "stream": True},
                      timeout=60) as busy:  # both slots
        next(busy.iter_lines())
        with pytest.raises(httpx.ReadTimeout):  # queued behind them, then hung up on
            httpx.post(f"{server.url}/completions", json={**long, "prompt": "cd"}, timeout=0.5)
        assert wait_until(lambda: not server.engine.waiting, "the queue empty", 1.5) < 1.5
        assert any(server.engine.active)  # the streams decode on
    assert wait_until(lambda: held(server) == 0, "the streams' slots free", 1.5) < 1.5
    with pytest.raises(httpx.ReadTimeout):  # decoding, answered whole, hung up on
        httpx.post(f"{server.url}/completions", json={**long, "prompt": "ef"}, timeout=0.5)
    assert wait_until(lambda: held(server) == 0, "its slot free", 1.5) < 1.5
    answer = httpx.post(f"{server.url}/completions", json={"prompt": "gh", "max_tokens": 3}, timeout=60)
    assert answer.status_code == 200
