"""The ASGI middleware in front of every route of the server."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxgpt.serve.metrics import Metrics
from jaxgpt.serve.protocol import error_body

# Always served without the API key: the health check, and the chat page, a static file that asks for the key
# itself. `jaxgpt serve --open_paths` adds others (vLLM leaves its tokenizer routes outside the key).
OPEN_PATHS = ("/health", "/")


class Guard:
    """ASGI middleware in front of every route: the API key (all paths but `open_paths`), the body limit (read
    whole here, so an oversized body is a 413 before any handler runs) and the count of answers by path and
    status."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, metrics: Metrics,
                 paths: Callable[[], set[str]], open_paths: tuple[str, ...]) -> None:
        self.app, self.api_key, self.max_body_bytes, self.metrics, self.paths = app, api_key, max_body_bytes, \
            metrics, paths
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in self.paths() else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] not in self.open_paths:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                body = error_body("no valid API key: send the header 'Authorization: Bearer KEY' with the key the "
                                  "server was started with", code="invalid_api_key")
                await JSONResponse(body, 401)(scope, receive, counted)
                return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                body = error_body(f"the request body is over {self.max_body_bytes:,} bytes: send a smaller one")
                await JSONResponse(body, 413)(scope, receive, counted)
                return
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, counted)

