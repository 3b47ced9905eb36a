"""The server's processes: the engine's (the caller's, which runs `jaxgpt.serve.core.Core`) and N HTTP front ends
(`jaxgpt serve --api_servers N`) that share one listening socket, as uvicorn's workers do; the kernel hands each
new connection to one of them.

A front end is a spawned process that never touches the accelerator (jax runs on the CPU there: the tokenizer and
the HTTP work need no device). It says ("built",) over its connection once it has built its app, or ("failed",
message) when it cannot (a UserError); it serves once told ("serve",), and says ("ready",) then. SIGTERM
(uvicorn's graceful shutdown) makes it finish its requests in flight, then close its connection; the engine's
side returns once every front end has closed. One that dies otherwise (a crash, SIGKILL, the kernel's OOM killer)
is replaced at once by a spare (`FrontEnds.replace`, which `jaxgpt.serve.core.Core` calls) while the others keep
serving; the connections it held are lost. One whose engine's process has ended answers 503 to what it had and
shuts down, with exit status 1.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import socket
import sys
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from jaxgpt.errors import UserError
from jaxgpt.serve.app import Served

GRACE_S = 60  # seconds a front end's shutdown waits for its requests in flight


def listen(host: str, port: int) -> socket.socket:
    """The listening socket the front ends share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


class FrontEnds:
    """The front ends' processes on `sock`, which stays open here so that one that dies can be replaced, and a
    spare, started like them but waiting to be told to serve: a replacement then serves at once, not after the
    seconds a process takes to import jax and build its app."""

    def __init__(self, served: Served, version: str | None, sock: socket.socket) -> None:
        self.served, self.version, self.sock = served, version, sock
        self.spawn = multiprocessing.get_context("spawn")
        self.procs: dict[Connection, BaseProcess] = {}  # by the engine's end of each one's connection
        self.names = itertools.count()
        self.stopping = False
        self.spare: Connection | None = None

    def start(self, n: int) -> list[Connection]:
        """Spawn `n` front ends and the spare; the engine's ends of the front ends' connections, once each serves.
        One that cannot build its app is a UserError (the others are stopped)."""
        conns = [self._spawn() for _ in range(n + 1)]
        for conn in conns:
            answer = conn.recv() if conn.poll(600) else ("failed", "a front end did not start within 600 s")
            if answer[0] != "built":
                for proc in self.procs.values():
                    proc.terminate()
                raise UserError(answer[1])
        *conns, self.spare = conns
        for conn in conns:
            conn.send(("serve",))
        return conns

    def _spawn(self) -> Connection:
        ours, theirs = self.spawn.Pipe()
        proc = self.spawn.Process(target=_front_end, args=(theirs, self.sock, self.served, self.version),
                                  name=f"jaxgpt-api-{next(self.names)}")
        proc.start()
        theirs.close()
        self.procs[ours] = proc
        return ours

    def replace(self, conn: Connection) -> Connection | None:
        """The front end at `conn` has closed it: unless the server is stopping, the spare takes its place (it says
        ("ready",) once it serves) and another spare starts; the engine's end of the new front end's connection."""
        proc = self.procs.pop(conn)
        conn.close()
        if self.stopping:
            return None
        proc.join(timeout=1)  # it has closed its end: it is exiting, if not gone
        print(f"front end {proc.name} (pid {proc.pid}) ended (exit status {proc.exitcode}): its spare takes its "
              "place", file=sys.stderr, flush=True)
        new, self.spare = self.spare, self._spawn()
        try:
            new.send(("serve",))
        except OSError:  # the spare has died too: the new one serves once it has started
            new, self.spare = self.spare, self._spawn()
            new.send(("serve",))
        return new

    def stop(self) -> None:
        """Ask each front end to finish its requests in flight, then close its end (SIGTERM); none is replaced."""
        self.stopping = True
        for proc in list(self.procs.values()):
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    def join(self) -> None:
        for proc in list(self.procs.values()):
            proc.join()


def _front_end(conn: Connection, sock: socket.socket, served: Served, version: str | None) -> None:
    """A front end's process: the app on `sock`, its engine at `conn`'s other end, until SIGTERM or the engine's
    end closes (then it exits with status 1)."""
    import jax
    import uvicorn

    from jaxgpt.serve.app import create_app
    from jaxgpt.serve.client import EngineClient

    os.setpgid(0, 0)  # Ctrl-C reaches the engine's process, which asks each front end to finish (no second signal)
    jax.config.update("jax_platforms", "cpu")  # the accelerator is the engine's
    engine = EngineClient(conn, version, on_lost=lambda: signal.raise_signal(signal.SIGTERM))
    try:
        app = create_app(engine, served)
    except UserError as e:
        conn.send(("failed", str(e)))
        return
    conn.send(("built",))
    try:
        conn.recv()  # ("serve",): at once, or when this spare replaces a front end that died
    except EOFError:  # the engine's process has ended first
        return
    conn.send(("ready",))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACE_S)
    uvicorn.Server(config).run(sockets=[sock])
    if engine.lost:
        sys.exit(1)
