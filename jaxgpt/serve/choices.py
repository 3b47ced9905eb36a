"""A request's choices as the handlers see them: each one engine request whose tokens, prompt log-probabilities
and end reach the event loop through an asyncio queue (`jaxgpt.serve.client` puts them there), its text so far
(cut where a stop string appears), and the bodies OpenAI's clients parse (completions and chat logprobs, usage,
server-sent events)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException

from jaxgpt.data.pairs import PairText
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.generate.text_stream import StreamDecoder, first_stop, held_back
from jaxgpt.serve.client import LOST, EngineClient, EngineLostError
from jaxgpt.serve.metrics import Metrics
from jaxgpt.serve.protocol import Sampling, error_body

Codec = Tokenizer | PairText  # a GPT's tokenizer, or an encoder-decoder's source/target text


@dataclasses.dataclass
class Choice:
    """One choice's tokens as they arrive, its text so far, and where stop strings cut it. `engine` runs it as
    request `rid`, on the weights `version` names."""

    index: int
    tokenizer: Codec
    stops: list[str]
    metrics: Metrics
    arrived: float  # time.perf_counter() when its HTTP request arrived
    engine: EngineClient | None = None
    rid: int | None = None  # None until the engine's queue took it
    version: str | None = None
    cancelled: bool = False
    prefix: str = ""  # the prompt's text, when echoed
    queue: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = dataclasses.field(default_factory=list)
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    generated: int = 0  # tokens the engine produced for it (end tokens included)
    last_token: float | None = None
    text: str = ""  # the text of `ids` but a partial character at its end, cut at a stop string
    sent: int = 0  # characters already streamed
    finish_reason: str | None = None
    decoder: StreamDecoder = dataclasses.field(init=False)  # decodes each token once, not the whole text again

    def __post_init__(self) -> None:
        self.decoder = StreamDecoder(self.tokenizer)

    def cancel(self) -> None:
        """End the choice at the engine (its slot frees at the next tick), once."""
        if not self.cancelled and self.rid is not None and self.engine is not None:
            self.engine.cancel(self.rid)
        self.cancelled = True

    def add(self, token: int, logprob: float, top: list[tuple[int, float]], end: bool) -> None:
        """A token from the engine: timed and counted, and unless it is an end token (`end`, which the engine
        says: end-of-text or a stop id, not text) added to the choice's ids and text."""
        now = time.perf_counter()
        if self.last_token is None:
            self.metrics.first_token.observe(now - self.arrived)
        else:
            self.metrics.inter_token.observe(now - self.last_token)
        self.last_token = now
        self.metrics.generated_tokens.inc()
        if self.finish_reason is not None:  # decoded in the step that a stop string ended the choice
            return
        self.generated += 1
        if not end:
            self.ids.append(token)
            self.logprobs.append((logprob, top))
            self._extend(self.decoder.push([token]))

    def done(self, reason: str) -> None:
        """The engine ended the choice (`Request.done`'s reason): the partial character held back joins the text,
        then the finish reason, unless a stop string in that text ended it."""
        self._extend(self.decoder.push([], final=True))
        if self.finish_reason is None:
            self.finish_reason = "length" if reason == "length" else "stop"

    def _extend(self, new: str) -> None:
        """`new` text onto the choice's, cut where a stop string first appears, which ends the choice. The text
        before held no stop string, so only a match reaching into `new` is looked for."""
        before, self.text = len(self.text), self.text + new
        if (cut := first_stop(self.text, self.stops, new_from=before)) is not None:
            self.text, self.finish_reason = self.text[:cut], "stop"
            self.cancel()

    def ready(self) -> str:
        """Text that can be streamed now: none that a stop string could still claim (the decoder already holds
        back a partial character)."""
        if self.finish_reason is not None:
            return self.text[self.sent:]
        return self.text[self.sent:max(len(self.text) - held_back(self.stops), self.sent)]

    def kept(self) -> int:
        """How many generated tokens the answer's text holds (a stop string cuts the rest)."""
        if self.finish_reason != "stop":
            return len(self.ids)
        return sum(1 for start in offsets([self.tokenizer.decode([t]) for t in self.ids]) if start < len(self.text))

    def completion_logprobs(self, k: int) -> dict[str, Any]:
        """OpenAI's completions logprobs: each token (the prompt's first when echoed, whose log-probability is
        null: nothing precedes it), its log-probability, the `k` most likely alternatives, its text offset."""
        decode = lambda t: self.tokenizer.decode([t])
        keep = self.kept()
        tokens = [decode(t) for t in self.prompt_ids] + [decode(t) for t in self.ids[:keep]]
        scored = ([] if self.prompt_logprobs is None else self.prompt_logprobs) + self.logprobs[:keep]
        first: list[Any] = [None] if self.prompt_ids else []
        return {"tokens": tokens, "token_logprobs": first + [lp for lp, _ in scored],
                "top_logprobs": first + [{decode(i): lp for i, lp in top[:k]} for _, top in scored],
                "text_offset": offsets(tokens)}

    def chat_logprobs(self, k: int) -> dict[str, Any]:
        """OpenAI's chat logprobs: for each generated token its text, bytes, log-probability and top `k`."""
        entry = lambda t, lp: {"token": (s := self.tokenizer.decode([t])), "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top[:k]]}
                            for t, (lp, top) in zip(self.ids[:self.kept()], self.logprobs, strict=False)],
                "refusal": None}


def offsets(pieces: list[str]) -> list[int]:
    """Where each piece starts in their concatenation."""
    return [0, *itertools.accumulate(len(p) for p in pieces)][:len(pieces)]


def usage(choices: list[Choice], encoded: list[list[int]], n: int) -> dict[str, int]:
    prompt, completion = sum(len(ids) for ids in encoded) * n, sum(c.generated for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class EngineFailedError(Exception):
    """The engine failed while decoding a request (its thread printed the traceback)."""


async def next_event(choice: Choice) -> None:
    """Take the choice's next engine events (those of one tick of the engine), and those already queued behind
    them: streamed as one chunk, as vLLM's `stream_interval` does (a chunk per token would cost more than
    decoding it)."""
    for event in await choice.queue.get():
        _take(choice, *event)
    while choice.finish_reason is None and not choice.queue.empty():
        for event in choice.queue.get_nowait():
            _take(choice, *event)


def _take(choice: Choice, kind: str, value: Any) -> None:
    """One engine event into the choice: a token, the weights it runs on, the prompt's log-probabilities, or its
    end."""
    if kind == "token":
        choice.add(*value)
    elif kind == "version":
        choice.version = value
    elif kind == "prompt":
        choice.prompt_logprobs = value
    elif value == "error":
        raise EngineFailedError("the engine failed while decoding this request (the server's log has the traceback)")
    elif value == "lost":
        raise EngineLostError(LOST)
    elif choice.finish_reason is None:
        choice.done(value)


async def finish(choice: Choice) -> None:
    """Wait for the choice's end (a stop string's cut ends it here, before the engine says so)."""
    while choice.finish_reason is None or not choice.queue.empty():
        await next_event(choice)
        if choice.finish_reason is not None and choice.cancelled:
            return


async def disconnected(http: HTTPRequest) -> None:
    """Return once the client has gone: once the body is read, the server's next message is the disconnect."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def collect(choices: list[Choice], http: HTTPRequest) -> None:
    """Every choice to its end. An engine failure is a 500, a lost engine a 503 and a client that went away a 499
    (nginx's "client closed request", which nobody reads), each raised as an HTTPException; whatever ends it, no
    choice is left running."""
    work = asyncio.gather(*(finish(c) for c in choices))
    work.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read, once it is cancelled)
    gone = asyncio.ensure_future(disconnected(http))
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise HTTPException(499, "the client closed the connection before the answer")
        work.result()
    except EngineFailedError as e:
        raise HTTPException(500, str(e)) from None
    except EngineLostError as e:
        raise HTTPException(503, str(e)) from None
    finally:
        gone.cancel()
        work.cancel()
        for c in choices:
            if c.finish_reason is None:
                c.cancel()


def stream(choices: list[Choice], header: dict[str, Any],
                  chunk: Callable[[Choice, str, bool], dict[str, Any]], body: Sampling, encoded: list[list[int]]
                  ) -> StreamingResponse:
    """Server-sent events: a chunk per new piece of text of any choice (`chunk` shapes it), each choice's finish,
    the usage when stream_options asks, then [DONE]. With vLLM's continuous_usage_stats too, every chunk carries
    the usage so far (a client then knows how many tokens each chunk's text holds). A disconnect cancels the
    generator, and the choices with it."""
    options = body.stream_options
    with_usage = options is not None and options.include_usage
    every_chunk = with_usage and options.continuous_usage_stats

    async def events() -> AsyncIterator[str]:
        pending = {asyncio.ensure_future(next_event(c)): c for c in choices}
        started: set[int] = set()
        try:
            while pending:
                finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    choice = pending.pop(task)
                    try:
                        task.result()
                    except (EngineFailedError, EngineLostError) as e:
                        yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
                        return
                    text = choice.ready()
                    choice.sent += len(text)
                    if text or choice.finish_reason is not None:
                        first = choice.index not in started
                        started.add(choice.index)
                        data = {**header, "choices": [chunk(choice, text, first)]}
                        if every_chunk:
                            data["usage"] = usage(choices, encoded, body.n)
                        yield f"data: {json.dumps(data)}\n\n"
                    if choice.finish_reason is None:
                        pending[asyncio.ensure_future(next_event(choice))] = choice
            if with_usage:
                last = {**header, "choices": [], "usage": usage(choices, encoded, body.n)}
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for task, choice in pending.items():
                task.cancel()
                choice.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")
