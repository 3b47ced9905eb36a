"""The requests the server takes and the errors it answers, as pydantic models (FastAPI validates and documents them).

The fields are those OpenAI's clients and the ecosystem's tools send (the openai SDK, lm-evaluation-harness's
local-completions, GuideLLM, vLLM's own extensions such as `ignore_eos` and the tokenizer endpoints); any other
field is a 400, so a misspelt option never passes silently. Values are not coerced (strict models): `true` is
not the token id 1 nor `"5"` the number 5, as the OpenAPI document's types say.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxgpt.generate.engine import TOP_LOGPROBS

MAX_CHOICES = 16  # n at most (OpenAI's clients send small n; each choice takes a slot)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False  # a last chunk, with no choices, carries the request's usage
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class Sampling(BaseModel):
    """What completions and chat completions share: how many choices, how they are sampled and where they stop."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user's id: accepted (OpenAI's abuse monitoring), not used
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    ignore_eos: bool = False  # vLLM's: keep decoding past end-of-text (load tests ask for fixed lengths)


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, several texts, token ids, or several lists of token ids")
    max_tokens: int = Field(16, ge=0, description="0 only with echo: the prompt is scored, nothing generated")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # a template may read fields of its own (name, tool_calls)

    role: str
    content: str | list[ContentPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a template sees it: text parts joined into one content string."""
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        return {**self.model_dump(exclude_none=True), "content": content or ""}


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's: False continues the last message instead


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt's ids (special tokens are whatever the text spells; nothing is added)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body (see ErrorBody), as JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error body, which every client parses."""

    error: ErrorDetail


_WHY = {400: "the request is invalid (its message says which field and why)",
        401: "no valid API key: send Authorization: Bearer KEY",
        404: "the request's `model` is neither the base nor an adapter this server serves (GET /v1/models)",
        413: "the request body is larger than the server takes",
        429: "the server has no room now for all of the request's completions: retry later",
        500: "the engine failed while decoding the request",
        503: "the engine's process has ended: the server is shutting down to be restarted"}


def responses(*statuses: int, streams: bool = False) -> dict[int | str, dict[str, Any]]:
    """FastAPI's `responses=` for these error statuses, so the OpenAPI document declares each one; `streams`: a 200
    may also be server-sent events (stream=true), each a JSON chunk, which the document then declares too."""
    declared: dict[int | str, dict[str, Any]] = {status: {"model": ErrorBody, "description": _WHY[status]}
                                                 for status in statuses}
    if streams:
        event = {"type": "object", "required": ["data"], "properties": {
            "data": {"type": "string", "description": "a chunk of the answer as JSON; the last event's is [DONE]"}}}
        events = {"schema": event}
        declared[200] = {"description": "the answer; with stream=true, server-sent events",
                         "content": {"application/json": {}, "text/event-stream": events}}
    return declared
