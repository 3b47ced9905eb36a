"""The engine as an HTTP front end sees it: requests sent to the engine's side (`jaxgpt.serve.core`, whose
docstring has the messages) over one connection, and their events read back into each choice's queue.

The front end's event loop reads the connection itself (`loop.add_reader`): a message brings every event one
engine tick produced for this front end's requests, so the loop wakes once per tick, with no thread in between.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


class EngineLostError(Exception):
    """The engine's process has ended (its log says why): no request can be served."""


class EngineClient:
    """Submits requests to the engine at `conn`'s other end and routes its events to their queues. `state`:
    (requests waiting, busy slots, served version) as the engine last reported them. `on_lost` is called once if
    the engine's end closes (a front end's process then shuts down)."""

    def __init__(self, conn: Connection, version: str | None, on_lost: Callable[[], None] = lambda: None) -> None:
        self.conn, self.on_lost = conn, on_lost
        self.state: tuple[int, int, str | None] = (0, 0, version)
        self.queues: dict[int, asyncio.Queue] = {}
        self.queued: dict[int, asyncio.Future] = {}
        self.rids = itertools.count()
        self.lost = False
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def version(self) -> str | None:
        return self.state[2]

    def start(self) -> None:
        """Read the engine's messages in the running event loop (the app's startup)."""
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.conn.fileno(), self._receive)

    def close(self) -> None:
        """Stop reading and close this end: the engine cancels what this front end still had running."""
        if self.loop is not None and not self.lost:
            self.loop.remove_reader(self.conn.fileno())
        self.conn.close()

    async def submit(self, fields: dict[str, Any], score_prompt: bool, queue: asyncio.Queue) -> int | None:
        """Send a request (`Request`'s plain fields) whose events go to `queue`, each put a list of the events one
        tick brought; its id, or None when the engine's queue is full."""
        if self.lost:
            raise EngineLostError("the engine's process has ended: restart the server (its log says why)")
        rid = next(self.rids)
        self.queues[rid] = queue
        self.queued[rid] = queued = asyncio.get_running_loop().create_future()
        self.conn.send(("submit", rid, fields, score_prompt))
        if not await queued:
            del self.queues[rid]
            return None
        return rid

    def cancel(self, rid: int) -> None:
        """End request `rid` (its slot frees at the engine's next tick); ended ones are left alone."""
        if rid in self.queues and not self.lost:
            self.conn.send(("cancel", rid))

    def _receive(self) -> None:
        try:
            while self.conn.poll():
                events, self.state = self.conn.recv()
                for rid, happened in events.items():
                    self._route(rid, happened)
        except (EOFError, OSError):
            self._lose()

    def _route(self, rid: int, happened: list[tuple[str, Any]]) -> None:
        if happened[0][0] == "queued":
            self.queued.pop(rid).set_result(happened.pop(0)[1])
            if not happened:
                return
        queue = self.queues[rid] if happened[-1][0] != "done" else self.queues.pop(rid)
        queue.put_nowait(happened)

    def _lose(self) -> None:
        """The engine's end closed: every request still running ends in error, and so does every later one."""
        assert self.loop is not None
        self.loop.remove_reader(self.conn.fileno())
        self.lost = True
        for queued in self.queued.values():
            queued.set_exception(EngineLostError("the engine's process has ended"))
        for queue in self.queues.values():
            queue.put_nowait([("done", "error")])
        self.queued.clear()
        self.queues.clear()
        self.on_lost()
