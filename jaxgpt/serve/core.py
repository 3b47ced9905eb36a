"""The server's engine side (vLLM's "engine core"): the one `Engine`, fed by the HTTP front ends over pipes.

`jaxgpt serve` runs the engine in its own process and the HTTP front ends (`jaxgpt.serve.app`, started by
`jaxgpt.serve.launch`: requests, tokenizing, detokenizing, stop strings, server-sent events) in processes of their
own, as vLLM does since its OpenAI server left the engine's process. In one process the two share one interpreter
lock: on a GPU host the engine's thread then waits for the lock while the event loop frames events, and the device
idles between chunks (an H200 served 64 streaming clients half the tokens/s the engine alone gave them). Here the
engine's process runs Python only to dispatch chunks and hand their tokens over.

Messages, each a pickled tuple over a `multiprocessing` connection, one connection per front end:
front end -> core: ("submit", rid, fields, score_prompt), where `fields` are `Request`'s plain fields (prompt,
max_new_tokens, temperature, ...) and `score_prompt` asks for the prompt's log-probabilities; ("cancel", rid).
Closing the connection cancels that front end's requests (a front end that exits ends its streams).
core -> front end: (events, state): `events` maps a rid to its events in order, each (kind, value): "queued"
(whether the engine's queue took it, answered at once), "version" (the weights it was admitted on, before its
first other event), "token" ((token, logprob, top, end) as `Request.emit` gives them), "prompt" (the prompt's
(logprob, top) list) and "done" (`Request.done`'s reason, the last); `state` is (requests waiting, busy slots,
served version), what /metrics and /v1/models report. The engine's thread sends each front end one message per
tick (`Engine.run`'s `after_tick`), not one per token.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from jaxgpt.generate.engine import Engine, Request

Events = dict[int, list[tuple[str, Any]]]


class _Sink:
    """One request's callbacks: its events gathered until the engine's tick ends (`Core.send_gathered`)."""

    def __init__(self, rid: int, gathered: Events) -> None:
        self.rid, self.gathered, self.request = rid, gathered, None

    def put(self, kind: str, value: Any) -> None:
        events = self.gathered.setdefault(self.rid, [])
        if self.request is not None:  # first event since admission: the weights that answer it
            events.append(("version", self.request.version))
            self.request = None
        events.append((kind, value))

    def token(self, *picked: Any) -> None:
        self.put("token", picked)

    def prompt(self, scored: Any) -> None:
        self.put("prompt", scored)


class Core:
    """Serves `engine` to the front ends at the other ends of `conns` until each has closed its end."""

    def __init__(self, engine: Engine, conns: Sequence[Connection]) -> None:
        self.engine = engine
        self.locks = {conn: threading.Lock() for conn in conns}  # the engine's thread and `run`'s both send
        self.gathered: dict[Connection, Events] = {conn: {} for conn in conns}
        self.requests: dict[Connection, dict[int, Request]] = {conn: {} for conn in conns}
        self.reported: tuple[int, int, str | None] | None = None

    def run(self) -> None:
        """Take the front ends' messages (in this thread) while the engine runs in a thread of its own; once every
        front end has closed, let the requests in flight finish and return."""
        engine = threading.Thread(target=self.engine.run, kwargs={"after_tick": self.send_gathered},
                                  name="jaxgpt-engine", daemon=True)
        engine.start()
        open_ = list(self.locks)
        while open_:
            for conn in wait(open_):
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # that front end has exited
                    open_.remove(conn)
                    for request in list(self.requests[conn].values()):
                        request.cancelled = True
                    continue
                self._take(conn, *message)
        self.engine.stop()
        engine.join()

    def _take(self, conn: Connection, kind: str, rid: int, *rest: Any) -> None:
        requests = self.requests[conn]
        if kind == "cancel":
            if rid in requests:
                requests[rid].cancelled = True
            return
        fields, score_prompt = rest
        sink = _Sink(rid, self.gathered[conn])

        def done(reason: str) -> None:
            sink.put("done", reason)
            requests.pop(rid, None)

        request = Request(**fields, emit=sink.token, done=done, prompt_logprobs=sink.prompt if score_prompt else None)
        sink.request = request
        requests[rid] = request
        queued = self.engine.submit(request)
        if not queued:
            requests.pop(rid)
        self._send(conn, {rid: [("queued", queued)]})

    def state(self) -> tuple[int, int, str | None]:
        return len(self.engine.waiting), sum(b is not None for b in self.engine.active), self.engine.version

    def send_gathered(self) -> None:
        """On the engine's thread after each tick: each front end's events, and the state when it changed."""
        state = self.state()
        changed, self.reported = state != self.reported, state
        for conn, gathered in self.gathered.items():
            if gathered or changed:
                events = dict(gathered)
                gathered.clear()
                self._send(conn, events, state)

    def _send(self, conn: Connection, events: Events, state: tuple[int, int, str | None] | None = None) -> None:
        with self.locks[conn], contextlib.suppress(OSError):  # OSError: that front end has exited (`run` cancels
            conn.send((events, state or self.state()))  # its requests)
