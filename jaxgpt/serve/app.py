"""An OpenAI-compatible server over the continuous-batching engine (`jaxgpt.generate.engine`).

Endpoints: `POST /v1/completions` (prompts as text or token ids, one or many; max_tokens, temperature, top_p,
stop, n, seed, logit_bias, vLLM's ignore_eos; echo; logprobs up to 5, of the prompt's tokens too with echo;
stream as server-sent events, with usage in a last chunk when stream_options.include_usage asks, and in every
chunk with vLLM's continuous_usage_stats too),
`POST /v1/chat/completions` (messages rendered with the run's chat template, `jaxgpt.data.conversations`), vLLM's
`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info` (what lm-evaluation-harness's local-completions
uses), `GET /v1/models`, `GET /metrics` (Prometheus), `GET /health`, and `GET /`, a chat page for a browser
(`chat.html` beside this module) that streams from /v1/chat/completions.

The app is a front end: the engine runs in a process of its own (`jaxgpt.serve.core`), which it reaches through
an `EngineClient`; tokenizing, detokenizing, stop strings and server-sent events happen here, and `jaxgpt serve
--api_servers N` runs N front ends on one port. Each choice of a request is one engine request whose events reach
the handler through an asyncio queue. A bad request is a 400 with OpenAI's error body, a body over the limit a
413, a missing or wrong API key a 401 (on every path but /health, the page and `Served.open_paths`); none touches
the engine. A request's choices are admitted whole or not at all: more than the engine holds at once (its
capacity, /v1/models' `max_completions_per_request`: slots + waiting room) is a 400, more than it has room for
now a 429. A client that disconnects, or a request that fails, cancels its choices, which leave the engine's
queue or free their slots at its next tick; an engine whose process has ended is a 503.
Choice j of a request with `seed` s samples with seed s + j, so choice 0 is
`generate(..., key=s)`'s sample.

LoRA adapters (`jaxgpt serve --adapter NAME=PATH`, `Served.adapters`): a request's `model` names the base or an
adapter, whose choices then decode with it in the engine's shared batch; /v1/models lists the base and each
adapter (its `parent` the base, as vLLM's entries); any other name is a 404 with OpenAI's error body (code
model_not_found). Without adapters any `model` is the base, as clients configured with another name expect.

Which weights answered: every answer (each streamed chunk too) has OpenAI's `system_fingerprint`, the engine's
`version` of the weights its choices ran on (`step-N` for a run's checkpoint N; null for weights without
steps), and /v1/models's entry has the version served now. They change when `jaxgpt serve --follow`
(`jaxgpt.serve.follow`) swaps in a newer checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.resources
import secrets
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from jaxgpt.data.conversations import ChatTemplate
from jaxgpt.data.pairs import PairText
from jaxgpt.data.tokenizer_base import out_of_range
from jaxgpt.errors import UserError
from jaxgpt.generate.checks import check_request
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig, decoder_of
from jaxgpt.serve.choices import Choice, Codec, collect, stream, usage
from jaxgpt.serve.client import EngineClient, EngineLostError
from jaxgpt.serve.guard import OPEN_PATHS, Guard
from jaxgpt.serve.metrics import Metrics
from jaxgpt.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Sampling,
    TokenizeRequest,
    error_body,
    responses,
)

MAX_BODY_BYTES = 1 << 20  # a request body larger than this is a 413
NO_TEMPLATE = ("this model has no chat template: use /v1/completions, or start the server with "
               "`jaxgpt serve --chat_template FILE` (a Jinja2 template in the Hugging Face format), or put the "
               "template in the run's workdir as chat_template.jinja")


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param), status)


@dataclasses.dataclass(frozen=True)
class Served:
    """What a front end serves besides its engine (picklable: `jaxgpt serve` hands it to each front end's process).
    `chat_template`: a Jinja2 template's text (None: no chat); `chat_stop_ids`: tokens that end a chat reply like
    end-of-text (a chat run's end-of-turn token, a Hugging Face model's stop tokens), left out of its text;
    `open_paths`: paths answered without the API key besides /health and the page (`jaxgpt serve --open_paths`)."""

    tokenizer: Codec
    model_name: str
    cfg: ModelConfig | Seq2SeqConfig
    slots: int
    chat_template: str | None = None
    chat_stop_ids: tuple[int, ...] = ()
    chat_tokens: dict[str, str] | None = None  # the special tokens' text the template sees (None: end-of-text's)
    api_key: str | None = None
    open_paths: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA adapters the engine serves: (name, where it was read from)
    max_model_len: int | None = None  # the positions a request may use (`jaxgpt serve --max_model_len`; None: all)

    def context(self) -> int:
        """The positions a request's prompt and new tokens may take: --max_model_len, else the model's context."""
        return self.max_model_len or decoder_of(self.cfg).block_size

    def resolve(self, model: str | None) -> tuple[str, str | None]:
        """(the name an answer reports, the adapter its choices decode with) for a request's `model`. With
        adapters it names one of them or the base (`model_name`; none given: the base), else it is a 404
        (`UnknownModelError`); without, any name is the base, as before adapters existed (clients send the name
        they were configured with)."""
        if not self.adapters or model is None or model == self.model_name:
            return self.model_name, None
        if model in dict(self.adapters):
            return model, model
        raise UnknownModelError(f"The model `{model}` does not exist: this server has {self.model_name!r} and the "
                           f"adapters {', '.join(repr(name) for name, _ in self.adapters)} (GET /v1/models)")


class UnknownModelError(Exception):
    """A request names a model this server does not serve: a 404 with OpenAI's error body (code model_not_found)."""


class Header(Mapping[str, Any]):
    """An answer's top-level fields. Its `system_fingerprint` is read as each chunk is made: which weights answer
    is known only once the engine has admitted the choices (a swap waiting admits none)."""

    def __init__(self, fields: dict[str, Any], choices: list[Choice]) -> None:
        self.fields, self.choices = fields, choices

    def __getitem__(self, key: str) -> Any:
        if key != "system_fingerprint":
            return self.fields[key]
        versions = dict.fromkeys(c.version for c in self.choices if c.version is not None)
        return "+".join(versions) or None  # (choices split by a swap, n beyond the free slots: both versions)

    def __iter__(self) -> Iterator[str]:
        return iter([*self.fields, "system_fingerprint"])

    def __len__(self) -> int:
        return len(self.fields) + 1


@contextlib.asynccontextmanager
async def _lifespan(engine: EngineClient, app: FastAPI) -> AsyncIterator[None]:
    """The engine's messages are read while the server runs; its end closes once uvicorn has finished the
    requests in flight."""
    engine.start()
    yield
    engine.close()


def create_app(engine: EngineClient, served: Served) -> FastAPI:
    """The app of one front end, whose requests `engine` runs. A UserError names an open path it does not serve."""
    app = FastAPI(title="jaxgpt", lifespan=functools.partial(_lifespan, engine))
    tokenizer, api_key = served.tokenizer, served.api_key
    metrics = Metrics(engine, served.slots)
    guarded = (401, 413) if api_key is not None else (413,)
    paths = lambda: {route.path for route in app.routes}
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=served.max_body_bytes, metrics=metrics, paths=paths,
                       open_paths=OPEN_PATHS + served.open_paths)
    context = served.context()
    eos = tokenizer.decode([tokenizer.eot_token]) if tokenizer.eot_token is not None else ""
    tokens = served.chat_tokens if served.chat_tokens is not None else {"bos_token": eos, "eos_token": eos}
    chat_template = ChatTemplate(served.chat_template, **tokens) if served.chat_template is not None else None

    _error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    page = importlib.resources.files("jaxgpt.serve").joinpath("chat.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        """The chat page (jaxgpt/serve/chat.html): static, so served without the API key, which it sends."""
        return HTMLResponse(page)

    @app.get("/metrics", response_class=Response, responses=responses(*guarded))
    async def scrape() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=responses(*guarded))
    async def models() -> dict[str, Any]:
        """OpenAI's list of models: the base, then each adapter, whose entry names the base as its `parent` and
        where it was read from as its `root`, as vLLM lists LoRA adapters."""
        card = {"object": "model", "created": 0, "owned_by": "jaxgpt", "max_model_len": context,
                "max_completions_per_request": await engine.capacity(), "system_fingerprint": engine.version}
        base = {"id": served.model_name, **card, "root": served.model_name, "parent": None}
        return {"object": "list", "data": [base, *({"id": name, **card, "root": root, "parent": served.model_name}
                                                   for name, root in served.adapters)]}

    _tokenizer_routes(app, tokenizer, context, chat_template, guarded)
    _generation_routes(app, engine, served, chat_template, metrics, context, guarded)
    if unknown := sorted(set(served.open_paths) - paths()):
        raise UserError(f"--open_paths: {', '.join(unknown)} is not a path this server answers: choose among "
                        f"{', '.join(sorted(paths() - set(OPEN_PATHS)))}")
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error is OpenAI's error body: a request that does not validate and a UserError a 400, an
    HTTPException its status, anything else a 500."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where)

    @app.exception_handler(HTTPException)
    async def http_error(_: HTTPRequest, exc: HTTPException) -> JSONResponse:
        kind = {429: "rate_limit_error"}.get(exc.status_code, "server_error" if exc.status_code >= 500
                                             else "invalid_request_error")
        answer = error(exc.status_code, str(exc.detail), kind)
        answer.headers.update(exc.headers or {})  # a 405's Allow
        return answer

    @app.exception_handler(Exception)
    async def failure(_: HTTPRequest, exc: Exception) -> JSONResponse:
        return error(500, f"the server failed on this request: {type(exc).__name__} (its log has the traceback)",
                     "server_error")

    @app.exception_handler(UserError)
    async def user_error(_: HTTPRequest, exc: UserError) -> JSONResponse:
        return error(400, str(exc))

    @app.exception_handler(UnknownModelError)
    async def unknown_model(_: HTTPRequest, exc: UnknownModelError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "invalid_request_error", "model", "model_not_found"), 404)

    @app.exception_handler(EngineLostError)
    async def engine_lost(_: HTTPRequest, exc: EngineLostError) -> JSONResponse:
        return error(503, str(exc), "server_error")


def _tokenizer_routes(app: FastAPI, tokenizer: Codec, context: int, chat_template: ChatTemplate | None,
                      guarded: tuple[int, ...]) -> None:
    """vLLM's tokenizer endpoints, at the server's root as vLLM has them (lm-evaluation-harness looks there)."""
    eos_text = tokenizer.decode([tokenizer.eot_token]) if tokenizer.eot_token is not None else None

    @app.get("/tokenizer_info", responses=responses(*guarded))
    async def tokenizer_info() -> dict[str, Any]:
        return {"tokenizer_class": type(tokenizer).__name__, "eos_token": eos_text, "bos_token": eos_text,
                "pad_token": None, "model_max_length": context, "vocab_size": tokenizer.vocab_size,
                "chat_template": chat_template.source if chat_template is not None else None}

    @app.post("/tokenize", responses=responses(400, *guarded))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ids = tokenizer.encode(body.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": context}

    @app.post("/detokenize", responses=responses(400, *guarded))
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if bad := out_of_range(body.tokens, tokenizer.vocab_size):
            raise UserError(f"tokens: ids {bad} are outside the vocabulary [0, {tokenizer.vocab_size})")
        return {"prompt": tokenizer.decode(body.tokens)}


def _generation_routes(app: FastAPI, engine: EngineClient, served: Served, chat_template: ChatTemplate | None,
                       metrics: Metrics, context: int, guarded: tuple[int, ...]) -> None:
    """/v1/completions and /v1/chat/completions: both check the request, start its choices and answer whole or
    as server-sent events; they differ in the prompt (given, or rendered from messages) and the answer's shape."""
    tokenizer, declared = served.tokenizer, responses(400, 404, 429, 500, 503, *guarded, streams=True)

    @app.post("/v1/completions", response_model=None, responses=declared)
    async def completions(body: CompletionRequest, http: HTTPRequest) -> Any:
        arrived, (model_name, adapter) = time.perf_counter(), served.resolve(body.model)  # an unknown model: 404
        texts, encoded = _prompts(body, tokenizer, await engine.capacity())
        if body.max_tokens == 0 and not body.echo:
            raise UserError("max_tokens: 0 generates nothing; it is only meaningful with echo=true")
        if body.echo and isinstance(tokenizer, PairText):
            raise UserError("echo: an encoder-decoder's prompt is its source, which it does not score")
        choices = await _start(body, encoded, body.max_tokens, engine, served, metrics, arrived, adapter,
                               score_prompt=body.echo and body.logprobs is not None)
        for c in choices if body.echo else []:
            c.prefix = texts[c.index // body.n]
        header = Header({"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion",
                         "created": int(time.time()), "model": model_name}, choices)

        def chunk(c: Choice, text: str, first: bool) -> dict[str, Any]:
            return {"index": c.index, "text": c.prefix + text if first else text, "finish_reason": c.finish_reason,
                    "logprobs": None}

        if body.stream:
            return stream(choices, header, chunk, body, encoded)
        await collect(choices, http)
        answers = [{"index": c.index, "text": c.prefix + c.text, "finish_reason": c.finish_reason,
                    "logprobs": c.completion_logprobs(body.logprobs) if body.logprobs is not None else None}
                   for c in choices]
        return {**header, "choices": answers, "usage": usage(choices, encoded, body.n)}

    @app.post("/v1/chat/completions", response_model=None, responses=declared)
    async def chat(body: ChatRequest, http: HTTPRequest) -> Any:
        arrived, (model_name, adapter) = time.perf_counter(), served.resolve(body.model)  # an unknown model: 404
        if chat_template is None:
            raise UserError(NO_TEMPLATE)
        text = chat_template.render([m.for_template() for m in body.messages], body.add_generation_prompt)
        encoded = [tokenizer.encode(text)]
        if (body.top_logprobs or 0) > 0 and not body.logprobs:
            raise UserError("top_logprobs: needs logprobs=true")
        limit = body.max_completion_tokens or body.max_tokens or max(context - len(encoded[0]), 1)
        choices = await _start(body, encoded, limit, engine, served, metrics, arrived, adapter, chat=True)
        header = Header({"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion.chunk",
                         "created": int(time.time()), "model": model_name}, choices)

        def chunk(c: Choice, text: str, first: bool) -> dict[str, Any]:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": c.index, "delta": delta, "finish_reason": c.finish_reason, "logprobs": None}

        if body.stream:
            return stream(choices, header, chunk, body, encoded)
        await collect(choices, http)
        answers = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason,
                    "logprobs": c.chat_logprobs(body.top_logprobs or 0) if body.logprobs else None}
                   for c in choices]
        return {**header, "object": "chat.completion", "choices": answers, "usage": usage(choices, encoded, body.n)}


def _prompts(body: CompletionRequest, tokenizer: Codec, capacity: int) -> tuple[list[str], list[list[int]]]:
    """Each prompt's text and ids (an empty GPT prompt starts from end-of-text); ids are checked by the engine.
    Prompts that, `n` each, could never fit in the engine's `capacity` are refused before any is tokenized."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]  # type: ignore[list-item]
    if not prompt:
        raise UserError("prompt: give at least one prompt")
    _check_size(len(prompt), body.n, capacity)
    starts = [] if isinstance(tokenizer, PairText) or tokenizer.eot_token is None else [tokenizer.eot_token]
    texts, encoded = [], []
    for p in prompt:
        if isinstance(p, str):
            texts.append(p)
            encoded.append(tokenizer.encode(p) if p else starts)
        else:
            if bad := out_of_range(p, tokenizer.vocab_size):
                raise UserError(f"prompt: token ids {bad} are outside the vocabulary [0, {tokenizer.vocab_size})")
            texts.append(tokenizer.decode(p))
            encoded.append(list(p) or starts)
    return texts, encoded


def _logit_bias(body: Sampling, vocab_size: int) -> dict[int, float]:
    """The request's logit_bias with integer ids, each checked (OpenAI's range: a bias in [-100, 100])."""
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise UserError(f"logit_bias: {key!r} is not a token id in [0, {vocab_size})")
        if not -100 <= value <= 100:
            raise UserError(f"logit_bias: the bias {value} of token {key} is not in [-100, 100]")
        bias[int(key)] = value
    return bias


def _check_size(prompts: int, n: int, capacity: int) -> None:
    """A UserError (a 400) for a request of more completions than the engine ever holds at once."""
    if prompts * n > capacity:
        raise UserError(f"prompt: {prompts} prompt(s) x n={n} is {prompts * n} completions, over this server's "
                        f"limit of {capacity} per request (max_completions_per_request in /v1/models: its slots "
                        f"and waiting room): send them in several requests")


async def _start(body: CompletionRequest | ChatRequest, encoded: list[list[int]], max_tokens: int,
                 engine: EngineClient, served: Served, metrics: Metrics, arrived: float, adapter: str | None, *,
                 score_prompt: bool = False, chat: bool = False) -> list[Choice]:
    """Check the request, then submit `n` choices per prompt, each an engine request whose events feed it, all or
    none. A UserError is a 400 (more choices than the engine ever holds too) and no room for them all now a 429.
    A chat's replies also end at `served.chat_stop_ids`; every choice decodes with `adapter` (None: the base)."""
    tokenizer = served.tokenizer
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if not all(stops):
        raise UserError("stop: every stop string must be non-empty")
    logprobs = body.logprobs is not None if isinstance(body, CompletionRequest) else bool(body.logprobs)
    if body.stream and logprobs:
        raise UserError("logprobs: not available with stream=true here; ask without streaming")
    bias = _logit_bias(body, tokenizer.vocab_size)
    for ids in encoded:
        check_request(served.cfg, ids, max_tokens, body.temperature, body.top_p, served.context())
    capacity = await engine.capacity()
    _check_size(len(encoded), body.n, capacity)
    seed = body.seed if body.seed is not None else secrets.randbits(31)
    choices = [Choice(i, tokenizer, stops, metrics, arrived, engine, prompt_ids=ids if score_prompt else [])
               for i, ids in enumerate(ids for ids in encoded for _ in range(body.n))]
    fields = [{"prompt": ids, "max_new_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
               "seed": seed + j, "logit_bias": bias, "ignore_eos": body.ignore_eos, "logprobs": logprobs,
               "stop_ids": served.chat_stop_ids if chat else (), "adapter": adapter}
              for ids in encoded for j in range(body.n)]
    rids = await engine.submit([(f, c.queue) for f, c in zip(fields, choices, strict=True)], score_prompt)
    if rids is None:
        raise HTTPException(429, f"the server is full: it has no room now for this request's {len(fields)} "
                                 f"completion(s) (it holds {capacity} at once): retry later")
    for choice, rid in zip(choices, rids, strict=True):
        choice.rid = rid
    metrics.prompt_tokens.inc(sum(len(ids) for ids in encoded) * body.n)
    return choices
