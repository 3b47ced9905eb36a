"""`jaxgpt serve`'s processes when one is lost, on 127.0.0.1: a front end killed (SIGKILL) under load is replaced
within seconds while the other serves on, and leaves no row in the engine; when the engine's process is killed,
every request its front ends hold is answered 503 with the reason, and they exit with status 1, freeing the port
for a supervisor to restart the server."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from helpers import gauges, serving  # noqa: E402
from helpers.models import random_params, save_run  # noqa: E402
from helpers.server import CFG, TOKENIZER  # noqa: E402

ENV = {"JAX_PLATFORMS": "cpu"}


def front_ends(pid: int) -> list[int]:
    """The process ids of `jaxgpt serve` process `pid`'s front ends and their spare, in the order started (its
    spawned children, not the resource tracker multiprocessing also starts)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in command:
            found.append(int(entry.name))
    return sorted(found)


def gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie whose parent has not reaped it counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_run(tmp_path_factory.mktemp("serve") / "run", CFG, random_params(CFG), TOKENIZER.to_meta())


def test_a_front_end_killed_under_load_is_replaced_while_the_other_serves(run, tmp_path):
    """16 clients ask one after another; one of two front ends is SIGKILLed: only requests on its connections fail
    (at most one per client), none is a 5xx, a replacement serves within 5 s, the clients go on being answered,
    and the engine holds nothing once they stop (today's main: no replacement)."""
    log = tmp_path / "stderr.txt"
    with serving(f"--workdir={run}", "--api_servers=2", "--slots=8", "--chunk=2", log=log, env=ENV) as (proc, url):
        pids = front_ends(proc.pid)
        assert len(pids) >= 2  # two serving (started first), and their spare
        stop, killed = threading.Event(), threading.Event()
        after_kill: list[int] = []

        def client(c: int) -> tuple[list[int], int]:
            statuses, errors = [], 0
            with httpx.Client(base_url=url, timeout=60) as http:
                while not stop.is_set():
                    try:
                        answer = http.post("/v1/completions", json={**body, "seed": c})
                    except httpx.TransportError:
                        errors += 1
                        continue
                    statuses.append(answer.status_code)
                    if killed.is_set():
                        after_kill.append(c)
            return statuses, errors

        body = {"prompt": "ab", "max_tokens": 30}
        with concurrent.futures.ThreadPoolExecutor(16) as pool:  # compiled first: every row count's chunk
            assert {a.status_code for a in pool.map(lambda c: httpx.post(f"{url}/v1/completions", json=body,
                                                                         timeout=120), range(16))} == {200}
            clients = [pool.submit(client, c) for c in range(16)]
            try:
                time.sleep(2)
                os.kill(pids[0], signal.SIGKILL)
                killed.set()
                t = time.perf_counter()
                while "is serving" not in log.read_text():
                    assert time.perf_counter() - t < 5, f"not replaced within 5 s\n{log.read_text()}"
                    time.sleep(0.05)
                replaced = time.perf_counter() - t
                while len(after_kill) < 16:  # answers after the kill (a loaded CPU decodes slowly)
                    assert time.perf_counter() - t < 120, f"{len(after_kill)} answers in 120 s after the kill"
                    time.sleep(0.05)
            finally:
                stop.set()
            results = [c.result() for c in clients]
        statuses = [s for got, _ in results for s in got]
        assert set(statuses) == {200}, sorted(set(statuses))
        assert sum(errors for _, errors in results) <= 16, results
        assert pids[0] not in front_ends(proc.pid) and len(front_ends(proc.pid)) == 3  # a new spare too
        t = time.perf_counter()
        while gauges(url) != (0, 0):
            assert time.perf_counter() - t < 2, gauges(url)
            time.sleep(0.05)
        print(f"replaced in {replaced:.2f} s; {len(statuses)} answers, {len(after_kill)} after the kill")
    assert "Traceback" not in log.read_text()


def test_the_engine_process_killed_is_a_503_from_every_front_end_and_they_exit(run, tmp_path):
    """One slot decoding a token per dispatch, a queue of requests over two front ends; the engine's process is
    SIGKILLed: every request still waiting for its answer gets a 503 saying why (a stream: an error event), and the
    front ends exit with status 1, leaving the port free (today's main: 500s)."""
    log = tmp_path / "stderr.txt"
    with serving(f"--workdir={run}", "--api_servers=2", "--slots=1", "--chunk=1", "--max_waiting=64", log=log,
                 env=ENV) as (proc, url):
        pids = front_ends(proc.pid)
        port = int(url.rpartition(":")[2])
        body = {"prompt": "ab", "max_tokens": 60, "temperature": 0}

        def ask(i: int) -> tuple[int, str]:
            with httpx.Client(base_url=url, timeout=60) as http:
                if i % 4:
                    answer = http.post("/v1/completions", json=body)
                    return answer.status_code, answer.json()["error"]["message"] if answer.status_code >= 400 else ""
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as answer:
                    return answer.status_code, [line for line in answer.iter_lines() if line][-1]

        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            answers = [pool.submit(ask, i) for i in range(24)]
            t = time.perf_counter()
            while gauges(url)[0] < 12:
                assert time.perf_counter() - t < 30, gauges(url)
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            got = [a.result() for a in answers]
        assert proc.wait(timeout=10) == -signal.SIGKILL
    failed = [(status, why) for status, why in got if status != 200 or "error" in why]
    assert len(failed) >= 10, got
    for status, why in failed:
        assert status in (200, 503) and "the engine's process has ended" in why, (status, why)
    t = time.perf_counter()
    while not all(map(gone, pids)):
        assert time.perf_counter() - t < 30, "the front ends did not exit"
        time.sleep(0.1)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens: a supervisor's restart can bind it
