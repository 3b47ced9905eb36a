"""The server's processes: the engine's (the caller's, which runs `jaxgpt.serve.core.Core`) and N HTTP front ends
(`jaxgpt serve --api_servers N`) that share one listening socket, as uvicorn's workers do; the kernel hands each
new connection to one of them.

A front end is a spawned process that never touches the accelerator (jax runs on the CPU there: the tokenizer and
the HTTP work need no device). It answers over its connection once, ("ready",) or ("failed", message) when its
app cannot be built (a UserError), before it serves. SIGTERM (uvicorn's graceful shutdown) makes it finish its
requests in flight, then close its connection; the engine's side returns once every front end has closed.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from jaxgpt.errors import UserError
from jaxgpt.serve.app import Served

GRACE_S = 60  # seconds a front end's shutdown waits for its requests in flight


def listen(host: str, port: int) -> socket.socket:
    """The listening socket the front ends share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def start_front_ends(served: Served, version: str | None, sock: socket.socket, n: int
                     ) -> tuple[list[BaseProcess], list[Connection]]:
    """Spawn `n` front ends on `sock`; their processes and the engine's ends of their connections, once each is
    ready. A front end that cannot start is a UserError (the others are stopped)."""
    spawn = multiprocessing.get_context("spawn")
    procs, conns = [], []
    for i in range(n):
        ours, theirs = spawn.Pipe()
        procs.append(spawn.Process(target=_front_end, args=(theirs, sock, served, version), name=f"jaxgpt-api-{i}"))
        procs[-1].start()
        theirs.close()
        conns.append(ours)
    for conn in conns:
        answer = conn.recv() if conn.poll(600) else ("failed", "a front end did not start within 600 s")
        if answer[0] != "ready":
            for proc in procs:
                proc.terminate()
            raise UserError(answer[1])
    return procs, conns


def _front_end(conn: Connection, sock: socket.socket, served: Served, version: str | None) -> None:
    """A front end's process: the app on `sock`, its engine at `conn`'s other end, until SIGTERM or the engine's
    end closes."""
    import signal

    import jax
    import uvicorn

    from jaxgpt.serve.app import create_app
    from jaxgpt.serve.client import EngineClient

    os.setpgid(0, 0)  # Ctrl-C reaches the engine's process, which asks each front end to finish (no second signal)
    jax.config.update("jax_platforms", "cpu")  # the accelerator is the engine's
    try:
        app = create_app(EngineClient(conn, version, on_lost=lambda: signal.raise_signal(signal.SIGTERM)), served)
    except UserError as e:
        conn.send(("failed", str(e)))
        return
    conn.send(("ready",))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACE_S)
    uvicorn.Server(config).run(sockets=[sock])
