"""An OpenAI-compatible completions server over the continuous-batching engine (`jaxgpt.generate.engine`).

Endpoints: `POST /v1/completions` (prompt as a string or a list, max_tokens, temperature, top_p, stop, n, seed,
stream as server-sent events, logprobs up to 5), `GET /v1/models`, `GET /health`. The engine decodes in a
thread of its own; each choice of a request is one engine request whose tokens reach the handler through an
asyncio queue. A bad request is a 400 with OpenAI's error body and a full queue a 429; neither touches the
engine. A client that disconnects cancels its choices, which free their slots before the next decode step.
Choice j of a request with `seed` s samples with seed s + j, so choice 0 is `generate(..., key=s)`'s sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.errors import UserError
from jaxgpt.generate.engine import TOP_LOGPROBS, Engine, Request
from jaxgpt.tasks.pairs import PairText

Codec = Tokenizer | PairText  # a GPT's tokenizer, or an encoder-decoder's source/target text


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


@dataclasses.dataclass
class Choice:
    """One choice's tokens as they arrive, its text so far, and where stop strings cut it."""

    index: int
    tokenizer: Codec
    stops: list[str]
    eot_token: int | None
    queue: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = dataclasses.field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters already streamed
    finish_reason: str | None = None
    request: Request | None = None

    def add(self, token: int, logprob: float, top: list[tuple[int, float]]) -> None:
        if self.finish_reason is not None:  # decoded in the step that a stop string ended the choice
            return
        if token != self.eot_token:
            self.ids.append(token)
            self.logprobs.append((logprob, top))
            self.text = self.tokenizer.decode(self.ids)
        for stop in self.stops:
            if (cut := self.text.find(stop)) >= 0:
                self.text, self.finish_reason = self.text[:cut], "stop"
                assert self.request is not None
                self.request.cancelled = True  # the slot frees before the next step

    def ready(self) -> str:
        """Text that can be streamed now: none that a stop string could still claim or a partial character."""
        if self.finish_reason is not None:
            return self.text[self.sent:]
        hold = max((len(s) - 1 for s in self.stops), default=0)
        end = len(self.text) - hold
        while end > self.sent and self.text[end - 1] == "\ufffd":
            end -= 1
        return self.text[self.sent:max(end, self.sent)]

    def logprob_body(self, k: int) -> dict[str, Any]:
        """OpenAI's logprobs object: each token, its log-probability, the `k` most likely alternatives."""
        tokens = [self.tokenizer.decode([t]) for t in self.ids]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        keep = sum(1 for o in offsets if o < len(self.text)) if self.finish_reason == "stop" else len(tokens)
        return {"tokens": tokens[:keep], "token_logprobs": [lp for lp, _ in self.logprobs[:keep]],
                "top_logprobs": [{self.tokenizer.decode([i]): lp for i, lp in top[:k]}
                                 for _, top in self.logprobs[:keep]],
                "text_offset": offsets[:keep]}


def create_app(engine: Engine, tokenizer: Codec, model_name: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        thread = threading.Thread(target=engine.run, name="jaxgpt-engine", daemon=True)
        thread.start()
        yield
        engine.stop()  # the requests in flight finish first (uvicorn has stopped accepting new ones)
        await asyncio.to_thread(thread.join)

    app = FastAPI(title="jaxgpt", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "jaxgpt"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, http: HTTPRequest) -> Any:
        try:
            encoded = _encode(body, tokenizer, engine)
        except UserError as e:
            return error(400, str(e))
        choices = _choices(body, encoded, tokenizer, asyncio.get_running_loop())
        for k, choice in enumerate(choices):
            if not engine.submit(choice.request):
                for earlier in choices[:k]:
                    earlier.request.cancelled = True
                return error(429, "the server's queue is full: retry later", kind="rate_limit_error")
        created, rid = int(time.time()), f"cmpl-{secrets.token_hex(12)}"
        header = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        if body.stream:
            return StreamingResponse(_events(choices, header), media_type="text/event-stream")
        try:
            await asyncio.gather(*(_finish(c, http) for c in choices))
        except RuntimeError as e:
            return error(500, str(e), kind="server_error")
        finally:
            for c in choices:
                c.request.cancelled = c.request.cancelled or c.finish_reason is None
        usage = {"prompt_tokens": sum(len(ids) for ids in encoded) * body.n,
                 "completion_tokens": sum(len(c.ids) for c in choices)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {**header, "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                                       "logprobs": c.logprob_body(body.logprobs) if body.logprobs is not None else None}
                                      for c in choices], "usage": usage}

    return app


def _encode(body: CompletionRequest, tokenizer: Codec, engine: Engine) -> list[list[int]]:
    """Each prompt's ids (an empty GPT prompt starts from end-of-text), every one checked; a UserError is a 400."""
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompts:
        raise UserError("prompt: give at least one prompt")
    if body.stop is not None and not all([body.stop] if isinstance(body.stop, str) else body.stop):
        raise UserError("stop: every stop string must be non-empty")
    if body.stream and body.logprobs is not None:
        raise UserError("logprobs: not available with stream=true here; ask without streaming")
    starts = [] if isinstance(tokenizer, PairText) or tokenizer.eot_token is None else [tokenizer.eot_token]
    encoded = [tokenizer.encode(p) if p else starts for p in prompts]
    for ids in encoded:
        engine.check(ids, body.max_tokens, body.temperature, body.top_p)
    return encoded


def _choices(body: CompletionRequest, encoded: list[list[int]], tokenizer: Codec,
             loop: asyncio.AbstractEventLoop) -> list[Choice]:
    """`n` choices per prompt, each with the engine request that feeds it from the engine's thread."""
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    seed = body.seed if body.seed is not None else secrets.randbits(31)
    choices: list[Choice] = []
    for ids in encoded:
        for j in range(body.n):
            choice = Choice(len(choices), tokenizer, stops, tokenizer.eot_token)
            choice.request = Request(
                ids, body.max_tokens, temperature=body.temperature, top_p=body.top_p, seed=seed + j,
                emit=lambda *a, c=choice: loop.call_soon_threadsafe(c.queue.put_nowait, ("token", a)),
                done=lambda reason, c=choice: loop.call_soon_threadsafe(c.queue.put_nowait, ("done", reason)))
            choices.append(choice)
    return choices


async def _next(choice: Choice) -> None:
    """Take one engine event into the choice."""
    kind, value = await choice.queue.get()
    if kind == "token":
        choice.add(*value)
    elif value == "error":
        raise RuntimeError("the engine failed while decoding this request (the server's log has the traceback)")
    elif choice.finish_reason is None:
        choice.finish_reason = "length" if value == "length" else "stop"


async def _finish(choice: Choice, http: HTTPRequest) -> None:
    """Wait for the choice's end; a disconnected client cancels it."""
    while choice.finish_reason is None or not choice.queue.empty():
        try:
            await asyncio.wait_for(_next(choice), timeout=0.5)
        except TimeoutError:
            if await http.is_disconnected():
                choice.request.cancelled = True
                return
        if choice.finish_reason is not None and choice.request.cancelled:
            return


async def _events(choices: list[Choice], header: dict[str, Any]) -> AsyncIterator[str]:
    """Server-sent events: a chunk per new piece of text of any choice, each choice's finish, then [DONE].
    A disconnect cancels the generator here, and the choices with it."""
    pending = {asyncio.ensure_future(_next(c)): c for c in choices}
    try:
        while pending:
            finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                choice = pending.pop(task)
                task.result()
                text = choice.ready()
                choice.sent += len(text)
                if text or choice.finish_reason is not None:
                    chunk = {"index": choice.index, "text": text, "finish_reason": choice.finish_reason,
                             "logprobs": None}
                    yield f"data: {json.dumps({**header, 'choices': [chunk]})}\n\n"
                if choice.finish_reason is None:
                    pending[asyncio.ensure_future(_next(choice))] = choice
        yield "data: [DONE]\n\n"
    finally:
        for task, choice in pending.items():
            task.cancel()
            choice.request.cancelled = True
