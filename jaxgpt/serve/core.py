"""The server's engine side (vLLM's "engine core"): the one `Engine`, fed by the HTTP front ends over pipes.

`jaxgpt serve` runs the engine in its own process and the HTTP front ends (`jaxgpt.serve.app`, started by
`jaxgpt.serve.launch`: requests, tokenizing, detokenizing, stop strings, server-sent events) in processes of their
own, as vLLM does since its OpenAI server left the engine's process. In one process the two share one interpreter
lock: on a GPU host the engine's thread then waits for the lock while the event loop frames events, and the device
idles between chunks (an H200 served 64 streaming clients half the tokens/s the engine alone gave them). Here the
engine's process runs Python only to dispatch chunks and hand their tokens over.

Messages, each a pickled tuple over a `multiprocessing` connection, one connection per front end:
front end -> core: ("submit", [(rid, fields, score_prompt), ...]), the engine requests of one HTTP request, taken
all or none (`Engine.submit`), where `fields` are `Request`'s plain fields (prompt, max_new_tokens, temperature,
...) and `score_prompt` asks for the prompt's log-probabilities; ("cancel", rid). Closing the connection cancels
that front end's requests (a front end that exits ends its streams). A front end started to replace one that
died says ("ready",) once it serves; ("built",) and ("failed", why) are `jaxgpt.serve.launch`'s start-up messages.
core -> front end: (events, state): `events` maps a rid to its events in order, each (kind, value): "queued"
(under a submit's first rid: whether the engine took its requests, answered at once), "version" (the weights it
was admitted on, before its first other event), "token" ((token, logprob, top, end) as `Request.emit` gives them),
"prompt" (the prompt's (logprob, top) list) and "done" (`Request.done`'s reason, the last); `state` is (requests
waiting, busy slots, served version, capacity: `Engine.capacity`), what /metrics and /v1/models report. Each front
end gets the state first, then one message per tick of the engine's thread (`Engine.run`'s `after_tick`), not one
per token, when it has events or the state changed.

A front end whose connection closes while the server runs (its process died) is replaced by `replace` (given by
`jaxgpt serve`), and the requests it had are cancelled: the other front ends keep serving meanwhile.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Sequence
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


class _FrontEnd:
    """One front end as the engine's side knows it: its connection, its requests by rid, and the events gathered
    for them in the engine's current tick. `ready`: it has served (a replacement once it says so)."""

    def __init__(self, conn: Connection, ready: bool) -> None:
        self.conn, self.ready = conn, ready
        self.lock = threading.Lock()  # the engine's thread and `run`'s both send
        self.gathered: Events = {}
        self.requests: dict[int, Request] = {}


class Core:
    """Serves `engine` to the front ends at the other ends of `conns` until each has closed its end. `replace`,
    given a dead front end's connection, starts another in its place and returns the engine's end of the new
    one's connection (None: none, as while the server shuts down)."""

    def __init__(self, engine: Engine, conns: Sequence[Connection],
                 replace: Callable[[Connection], Connection | None] | None = None) -> None:
        self.engine, self.replace = engine, replace
        self.front_ends = tuple(_FrontEnd(conn, ready=True) for conn in conns)  # swapped whole: the engine's
        self.reported: tuple[int, int, str | None, int] | None = None  # thread reads it as it sends

    def run(self) -> None:
        """Take the front ends' messages (in this thread) while the engine runs in a thread of its own; once every
        front end has closed, let the requests in flight finish and return."""
        engine = threading.Thread(target=self.engine.run, kwargs={"after_tick": self.send_gathered},
                                  name="jaxgpt-engine", daemon=True)
        engine.start()
        for front in self.front_ends:
            self._send(front, {})
        while self.front_ends:
            by_conn = {front.conn: front for front in self.front_ends}
            # a timeout, so that this thread runs a SIGTERM handler that Python could only flag (a signal taken by
            # another of the process's threads does not interrupt this wait; seen as a server that never stopped)
            for conn in wait(list(by_conn), timeout=1.0):
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # that front end has exited
                    self._closed(by_conn[conn])
                    continue
                self._take(by_conn[conn], *message)
        self.engine.stop()
        engine.join()

    def _closed(self, front: _FrontEnd) -> None:
        """A front end's end closed: its requests are cancelled and, if it had served, another takes its place."""
        for request in list(front.requests.values()):
            request.cancelled = True
        new = self.replace(front.conn) if self.replace is not None and front.ready else None
        added = (_FrontEnd(new, ready=False),) if new is not None else ()
        self.front_ends = tuple(f for f in self.front_ends if f is not front) + added
        for replacement in added:
            self._send(replacement, {})

    def _take(self, front: _FrontEnd, kind: str, *rest: Any) -> None:
        if kind == "cancel":
            if (request := front.requests.get(rest[0])) is not None:
                request.cancelled = True
        elif kind == "submit":
            self._submit(front, rest[0])
        elif kind == "ready":
            if not front.ready:
                print("the front end in place of the one that ended is serving", file=sys.stderr, flush=True)
            front.ready = True
        elif kind == "failed":  # a replacement could not start (its process exits; it is not replaced again)
            print(f"error: a front end could not start again: {rest[0]}", file=sys.stderr, flush=True)

    def _submit(self, front: _FrontEnd, batch: list[tuple[int, dict[str, Any], bool]]) -> None:
        """One HTTP request's engine requests, queued all or none; the answer goes under the first's rid."""
        requests = {rid: self._request(front, rid, fields, score_prompt) for rid, fields, score_prompt in batch}
        front.requests.update(requests)  # before `submit`: the engine's thread may end one at once
        queued = self.engine.submit(*requests.values())
        if not queued:
            for rid in requests:
                del front.requests[rid]
        self._send(front, {batch[0][0]: [("queued", queued)]})

    @staticmethod
    def _request(front: _FrontEnd, rid: int, fields: dict[str, Any], score_prompt: bool) -> Request:
        sink = _Sink(rid, front.gathered)

        def done(reason: str) -> None:
            sink.put("done", reason)
            front.requests.pop(rid, None)

        request = Request(**fields, emit=sink.token, done=done, prompt_logprobs=sink.prompt if score_prompt else None)
        sink.request = request
        return request

    def state(self) -> tuple[int, int, str | None, int]:
        engine = self.engine
        return len(engine.waiting), sum(b is not None for b in engine.active), engine.version, engine.capacity

    def send_gathered(self) -> None:
        """On the engine's thread after each tick: each front end's events, and the state when it changed."""
        state = self.state()
        changed, self.reported = state != self.reported, state
        for front in self.front_ends:
            if front.gathered or changed:
                events = dict(front.gathered)
                front.gathered.clear()
                self._send(front, events, state)

    def _send(self, front: _FrontEnd, events: Events, state: tuple[int, int, str | None, int] | None = None
              ) -> None:
        with front.lock, contextlib.suppress(OSError):  # OSError: that front end has exited (`run` cancels
            front.conn.send((events, state or self.state()))  # its requests)
