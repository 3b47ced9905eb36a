"""Real object-storage servers on 127.0.0.1 for the bucket tests: a GCS JSON-API server (gcp-storage-emulator)
and an S3 server (moto in server mode), each a subprocess, reached through a proxy the test can cut.

Clients find them through the standard variables (STORAGE_EMULATOR_HOST, AWS_ENDPOINT_URL and dummy AWS keys),
set in this process for in-process reads and handed to trainer subprocesses in `Server.env`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from helpers import free_port

BUCKET = "jaxgpt-test"


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"storage server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.2)
    raise RuntimeError(f"storage server did not listen on {port}")


class Proxy:
    """A TCP forwarder to `target_port`; `cut()` closes every connection and refuses new ones, as a storage
    server that went away (the server behind keeps its objects, so the test can read them afterwards)."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.open = True
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while self.open:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:  # a connection half-made during `cut` would hold the (single-threaded) GCS server
                if not self.open:
                    client.close()
                    upstream.close()
                    return
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(1 << 16):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        with self.lock:
            self.open = False
        self.listener.close()
        for s in self.sockets:  # shutdown first: it wakes the threads blocked in recv and sends the FIN
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


@dataclass
class Server:
    scheme: str
    proc: subprocess.Popen
    port: int
    proxy: Proxy = field(init=False)

    def __post_init__(self) -> None:
        self.proxy = Proxy(self.port)

    def endpoint(self, direct: bool = False) -> str:
        return f"http://127.0.0.1:{self.port if direct else self.proxy.port}"

    def env(self, direct: bool = False) -> dict[str, str]:
        """What a client needs to reach this server (through the proxy unless `direct`)."""
        if self.scheme == "gs":
            return {"STORAGE_EMULATOR_HOST": self.endpoint(direct), "TENSORSTORE_GCS_HTTP_URL": self.endpoint(direct),
                    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test"}  # tensorstore: no search for credentials
        return {"AWS_ENDPOINT_URL": self.endpoint(direct), "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def url(self, name: str = "") -> str:
        """A fresh path in the test bucket."""
        return f"{self.scheme}://{BUCKET}/{name or 'run'}-{uuid.uuid4().hex[:8]}"

    def stop(self) -> None:
        self.proxy.cut()
        self.proc.terminate()
        self.proc.wait(timeout=30)


def start(scheme: str, workdir: str) -> Server:
    """A server of `scheme` ("gs" or "s3") with the test bucket created, its data under `workdir`."""
    port = free_port()
    if scheme == "gs":
        cmd = [sys.executable, str(Path(__file__).with_name("gcs_server.py")), str(port), BUCKET]
    else:
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=os.environ.copy())
    wait_for_port(port, proc)
    server = Server(scheme, proc, port)
    if scheme == "s3":
        import boto3

        boto3.client("s3", endpoint_url=server.endpoint(direct=True), aws_access_key_id="test",
                     aws_secret_access_key="test", region_name="us-east-1").create_bucket(Bucket=BUCKET)
    return server


@contextlib.contextmanager
def client_env(server: Server) -> Iterator[None]:
    """This process's clients talk to `server` directly (and fresh fsspec instances pick that up)."""
    import fsspec

    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env(direct=True))
    fsspec.AbstractFileSystem.clear_instance_cache()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        fsspec.AbstractFileSystem.clear_instance_cache()
