"""The engine as an HTTP front end sees it: requests sent to the engine's side (`jaxgpt.serve.core`, whose
docstring has the messages) over one connection, and their events read back into each choice's queue.

The front end's event loop drives the connection itself, which it sets non-blocking: `loop.add_reader` reads
whatever has arrived (a message brings every event one engine tick produced for this front end's requests, so
the loop wakes once per tick, with no thread in between), and a message to send is queued and written as far as
the connection takes it, the rest by `loop.add_writer` as the engine drains it. So a send never fails or blocks
the loop because the engine is busy; a submit waits (without blocking the loop) while more than HIGH_WATER bytes
are queued. The bytes are those `multiprocessing.connection.Connection` writes and reads at the engine's end: a
4-byte signed big-endian length (-1, then an 8-byte one, past 2 GiB), then the pickle.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

HIGH_WATER = 1 << 20  # bytes queued for the engine beyond which a submit waits for them to drain
_LENGTH, _LONG = struct.Struct("!i"), struct.Struct("!Q")


class EngineLostError(Exception):
    """The engine's process has ended: no request can be served (a 503; the server exits to be restarted)."""


LOST = "the engine's process has ended (the server's log says why): this server is shutting down to be restarted"


def frame(message: Any) -> bytes:
    """`message` as a Connection at the other end reads it."""
    data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    header = _LENGTH.pack(len(data)) if len(data) <= 0x7FFFFFFF else _LENGTH.pack(-1) + _LONG.pack(len(data))
    return header + data


def unframe(buffer: bytearray) -> list[Any]:
    """The whole messages at the start of `buffer`, which loses their bytes (a partial one stays)."""
    messages, at = [], 0
    while len(buffer) - at >= _LENGTH.size:
        size, start = _LENGTH.unpack_from(buffer, at)[0], at + _LENGTH.size
        if size == -1:
            if len(buffer) - start < _LONG.size:
                break
            size, start = _LONG.unpack_from(buffer, start)[0], start + _LONG.size
        if len(buffer) - start < size:
            break
        messages.append(pickle.loads(buffer[start:start + size]))
        at = start + size
    del buffer[:at]
    return messages


class EngineClient:
    """Submits requests to the engine at `conn`'s other end and routes its events to their queues. `state`:
    (requests waiting, busy slots, served version, capacity) as the engine last reported them, capacity being the
    most requests it holds at once (slots + waiting room; None until its first message). `on_lost` is called once
    if the engine's end closes (a front end's process then shuts down)."""

    def __init__(self, conn: Connection, version: str | None, on_lost: Callable[[], None] = lambda: None) -> None:
        self.conn, self.on_lost = conn, on_lost
        self.state: tuple[int, int, str | None, int | None] = (0, 0, version, None)
        self.queues: dict[int, asyncio.Queue] = {}
        self.queued: dict[int, asyncio.Future] = {}
        self.rids = itertools.count()
        self.lost = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.inbox, self.outbox = bytearray(), bytearray()
        self.drained: asyncio.Event | None = None  # set while no more than HIGH_WATER bytes wait to be written
        self.greeted: asyncio.Event | None = None  # set once the engine's first message (its state) has come

    @property
    def version(self) -> str | None:
        return self.state[2]

    def start(self) -> None:
        """Drive the connection from the running event loop (the app's startup)."""
        self.loop = asyncio.get_running_loop()
        self.drained, self.greeted = asyncio.Event(), asyncio.Event()
        self.drained.set()
        os.set_blocking(self.conn.fileno(), False)
        self.loop.add_reader(self.conn.fileno(), self._receive)

    def close(self) -> None:
        """Stop and close this end: the engine cancels what this front end still had running."""
        if self.loop is not None and not self.lost:
            self.loop.remove_reader(self.conn.fileno())
            self.loop.remove_writer(self.conn.fileno())
        self.conn.close()

    async def capacity(self) -> int:
        """The most requests the engine holds at once: what one HTTP request may ask for at most."""
        assert self.greeted is not None, "start() first"
        await self.greeted.wait()
        if self.lost:
            raise EngineLostError(LOST)
        return self.state[3]

    async def submit(self, requests: list[tuple[dict[str, Any], asyncio.Queue]], score_prompt: bool
                     ) -> list[int] | None:
        """Send requests (`Request`'s plain fields, and the queue each one's events go to, each put a list of the
        events one tick brought), admitted all or none; their ids, or None when the engine has no room for all."""
        assert self.loop is not None and self.drained is not None, "start() first"
        await self.drained.wait()
        if self.lost:
            raise EngineLostError(LOST)
        rids = [next(self.rids) for _ in requests]
        self.queues.update(zip(rids, (queue for _, queue in requests), strict=True))
        self.queued[rids[0]] = queued = self.loop.create_future()
        self._send(("submit", [(rid, fields, score_prompt) for rid, (fields, _) in zip(rids, requests, strict=True)]))
        if not await queued:
            for rid in rids:
                del self.queues[rid]
            return None
        return rids

    def cancel(self, rid: int) -> None:
        """End request `rid` (its slot frees at the engine's next tick); ended ones are left alone."""
        if rid in self.queues and not self.lost:
            self._send(("cancel", rid))

    def _send(self, message: Any) -> None:
        self.outbox += frame(message)
        self._write()

    def _write(self) -> None:
        """Write what the connection takes now; while some is left, the loop writes more when it can."""
        assert self.loop is not None and self.drained is not None
        fd = self.conn.fileno()
        try:
            del self.outbox[:os.write(fd, self.outbox)]
        except BlockingIOError:
            pass
        except OSError:  # the engine's end closed: `_receive` sees it too
            self.outbox.clear()
        if self.outbox:
            self.loop.add_writer(fd, self._write)
        else:
            self.loop.remove_writer(fd)
        if len(self.outbox) > HIGH_WATER:
            self.drained.clear()
        else:
            self.drained.set()

    def _receive(self) -> None:
        try:
            while chunk := os.read(self.conn.fileno(), 1 << 16):
                self.inbox += chunk
            closed = True
        except BlockingIOError:
            closed = False
        except OSError:
            closed = True
        for events, state in unframe(self.inbox):
            self.state = state
            for rid, happened in events.items():
                self._route(rid, happened)
            assert self.greeted is not None
            self.greeted.set()
        if closed:
            self._lose()

    def _route(self, rid: int, happened: list[tuple[str, Any]]) -> None:
        if happened[0][0] == "queued":
            self.queued.pop(rid).set_result(happened.pop(0)[1])
            if not happened:
                return
        queue = self.queues[rid] if happened[-1][0] != "done" else self.queues.pop(rid)
        queue.put_nowait(happened)

    def _lose(self) -> None:
        """The engine's end closed: every request still running ends ("done", "lost"), and every later one is
        refused (EngineLostError)."""
        assert self.loop is not None
        self.loop.remove_reader(self.conn.fileno())
        self.loop.remove_writer(self.conn.fileno())
        self.lost = True
        for queued in self.queued.values():
            queued.set_exception(EngineLostError(LOST))
        for queue in self.queues.values():
            queue.put_nowait([("done", "lost")])
        self.queued.clear()
        self.queues.clear()
        assert self.greeted is not None and self.drained is not None
        self.greeted.set()  # (what waits on these sees `lost`)
        self.drained.set()
        self.on_lost()
