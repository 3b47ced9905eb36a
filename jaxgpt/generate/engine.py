"""Continuous batching: a fixed number of cache slots that requests take, decode in, and free between steps.

Each slot holds one request's KV cache (a batch-1 cache; the slots are stacked on a leading axis) with its
own length, step counter, key and sampling settings. A decode step runs the model's batch-1 decode under
`jax.vmap` over all slots, so every request decodes at its own position and one program serves any mix of
requests: nothing recompiles when requests come and go. A new request's prompt is prefilled into a free
slot, right-padded to a power-of-two bucket (one compile per bucket); the padding's keys and values sit
past the request's length, invisible to it, and are overwritten as it decodes.

An encoder-decoder's prompt is its source: a slot also holds the source's mask and cross-attention keys and
values (the source padded to src_block_size with the padding id, which the encoder masks), and its decoder
starts from bos, as `seq2seq.generate` starts a row.

Sampling is `generate`'s: step i of a request draws its noise from `fold_in(key, i)`, greedy at temperature
0, top-p only below 1, so a seeded request samples what `generate` samples for its prompt alone (up to
float rounding in the different batching of the products). The context does not slide: a request's prompt
and new tokens must fit in block_size.

What a server's clients ask for beyond sampling rides on the same two programs: a request's `logit_bias` is a
row added to its logits before the pick (the reported log-probabilities stay the model's own, as vLLM's
default), `ignore_eos` keeps a request decoding past end-of-text, and `prompt_logprobs` has the prefill,
which computes every prompt position's logits anyway, report each prompt token's log-probability (OpenAI's
`echo` with `logprobs`); a request for 0 new tokens is only that.

`swap` replaces the weights (same shapes: nothing recompiles) while the engine serves, as `jaxgpt serve --follow`
does with each new checkpoint of a run: from then on no request is admitted until the busy slots have
finished, so each request runs wholly on one set of weights, whose `version` it records.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxgpt.errors import UserError
from jaxgpt.evals.loglik import bucket
from jaxgpt.generate import seq2seq
from jaxgpt.generate.sampling import _decode, validate_options
from jaxgpt.generate.strategies import gumbel_noise, pick_tokens
from jaxgpt.model.attention import init_cache
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig
from jaxgpt.ops.decode import decoding_weights

Array = jax.Array
TOP_LOGPROBS = 5  # the most alternatives a request may ask for (OpenAI's completions allow 5)


@dataclasses.dataclass
class Request:
    """One generation. `emit(token, logprob, top)` is called from the engine's thread for every token, and
    `done(reason)` once ("stop": end of text, "length": max_new_tokens, "cancelled", "error": the engine failed).
    `prompt_logprobs`, when set, is called once after the prefill with (logprob, top) of prompt tokens 1.. (the
    first has no context); `logit_bias` maps token ids to what is added to their logits before each pick."""

    prompt: list[int]
    max_new_tokens: int
    emit: Callable[[int, float, list[tuple[int, float]]], None]
    done: Callable[[str], None]
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    cancelled: bool = False
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    ignore_eos: bool = False
    prompt_logprobs: Callable[[list[tuple[float, list[tuple[int, float]]]]], None] | None = None
    version: str | None = None  # set when admitted: the engine's `version`, the weights that answer it


class Slots(NamedTuple):
    """The device state of every slot (leading axis: the slot)."""

    cache: Any
    logits_SV: Array
    length_S: Array
    step_S: Array
    key_S: Array
    temperature_S: Array
    top_p_S: Array
    bias_SV: Array  # each slot's logit_bias, added to its logits before the pick
    memory: Any = None  # encoder-decoders: each slot's source mask (S, 1, L) and cross-attention keys/values


def _pick(logits_V: Array, key: Array, step: Array, temperature: Array, top_p: Array, banned: int | None,
          vocab_limit: int | None) -> Array:
    """`generate`'s choice for one row: greedy at temperature 0, top-p only below 1."""
    logits_1V = logits_V[None]
    gumbel_1V = gumbel_noise(key, step, logits_1V.shape)
    greedy = pick_tokens(logits_1V, None, banned=banned, vocab_limit=vocab_limit)
    free = pick_tokens(logits_1V, gumbel_1V, jnp.maximum(temperature, 1e-6), banned=banned, vocab_limit=vocab_limit)
    nucleus = pick_tokens(logits_1V, gumbel_1V, jnp.maximum(temperature, 1e-6), None, top_p, banned=banned,
                          vocab_limit=vocab_limit)
    return jnp.where(temperature == 0, greedy, jnp.where(top_p < 1, nucleus, free))[0]


def check_request(cfg: ModelConfig | Seq2SeqConfig, prompt: list[int], max_new_tokens: int, temperature: float,
                  top_p: float) -> None:
    """A UserError for a request the engine cannot run (the server answers it with a 400). An encoder-decoder's
    prompt is its source: at most src_block_size tokens, and max_tokens at most the decoder's context. A GPT's
    request may ask for 0 new tokens (only its prompt is scored)."""
    scores_only = max_new_tokens == 0 and not isinstance(cfg, Seq2SeqConfig)
    validate_options(1 if scores_only else max_new_tokens, temperature, None, top_p)
    if not prompt:
        raise UserError("the prompt is empty: give at least one token")
    if isinstance(cfg, Seq2SeqConfig):
        if len(prompt) > cfg.src_block_size or max_new_tokens > cfg.model.block_size:
            raise UserError(f"the source's {len(prompt)} tokens or max_tokens={max_new_tokens} exceed the model's "
                            f"src_block_size={cfg.src_block_size} / block_size={cfg.model.block_size}: shorten them")
        vocab_size = cfg.src_vocab_size
    elif len(prompt) + max_new_tokens > cfg.block_size:
        raise UserError(f"the prompt's {len(prompt)} tokens plus max_tokens={max_new_tokens} exceed the model's "
                        f"context of {cfg.block_size}: shorten the prompt or ask for fewer tokens")
    else:
        vocab_size = cfg.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise UserError(f"prompt token ids must be in [0, {vocab_size})")


class Engine:
    """Decodes up to `slots` requests at once; `submit` from any thread, `run` in one thread of its own."""

    def __init__(self, params: Any, cfg: ModelConfig | Seq2SeqConfig, *, slots: int = 8, max_waiting: int = 64,
                 eot_token: int | None = None, vocab_limit: int | None = None,
                 specials: dict[str, int] | None = None, version: str | None = None) -> None:
        """`specials`: an encoder-decoder's pad_id, bos_id and eos_id (its run's meta["seq2seq"]); eos ends a row.
        `version` names the weights (each request admitted records it)."""
        self.n_slots, self.max_waiting, self.eot_token, self.vocab_limit = slots, max_waiting, eot_token, vocab_limit
        self.version = version
        self.pending: tuple[Any, str] | None = None  # weights `swap` gave, and their version
        if isinstance(cfg, Seq2SeqConfig):
            if specials is None:
                raise UserError("an encoder-decoder needs its pad, bos and eos ids (the run's meta['seq2seq'])")
            self.params, self.cfg, self.specials, self.eot_token = params, cfg, specials, specials["eos_id"]
            model = cfg.model
            memory = jax.eval_shape(lambda: seq2seq.encode(params, cfg, jnp.zeros((1, cfg.src_block_size), jnp.int32)))
            memory = jax.tree.map(lambda c: jnp.zeros((slots, *c.shape), c.dtype), memory)
        else:
            self.params, self.cfg = decoding_weights(params, cfg, None, output_major=False)
            model, memory, self.specials = self.cfg, None, None
        self.given_cfg = cfg  # what `swap`'s weights are laid out for
        self.banned = model.pad_id
        one = init_cache(model, 1)
        self.state = Slots(jax.tree.map(lambda c: jnp.zeros((slots, *c.shape), c.dtype), one),
                           jnp.zeros((slots, model.vocab_size), jnp.float32), jnp.zeros(slots, jnp.int32),
                           jnp.zeros(slots, jnp.int32), jax.random.split(jax.random.key(0), slots),
                           jnp.zeros(slots, jnp.float32), jnp.ones(slots, jnp.float32),
                           jnp.zeros((slots, model.vocab_size), jnp.float32), memory)
        self.vocab_size = model.vocab_size
        self.active: list[Request | None] = [None] * slots
        self.produced = [0] * slots
        self.waiting: deque[Request] = deque()
        self.wake = threading.Condition()
        self.stopping = False

    def check(self, prompt: list[int], max_new_tokens: int, temperature: float, top_p: float) -> None:
        check_request(self.cfg, prompt, max_new_tokens, temperature, top_p)

    def submit(self, request: Request) -> bool:
        """Queue a checked request; False when the queue is full (the caller retries later)."""
        with self.wake:
            if len(self.waiting) >= self.max_waiting:
                return False
            self.waiting.append(request)
            self.wake.notify()
        return True

    def swap(self, params: Any, version: str) -> None:
        """Serve `params` (laid out as the constructor's, same shapes and dtypes) once the busy slots have
        finished; until then no request is admitted. A second swap before that replaces the first."""
        if self.specials is None:  # prepared here, in the caller's thread, not between the engine's steps
            params = decoding_weights(params, self.given_cfg, None, output_major=False)[0]
        with self.wake:
            self.pending = (params, version)
            self.wake.notify()

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()

    def run(self) -> None:
        """Admit, step and retire requests until `stop`; the requests in flight finish first."""
        while True:
            with self.wake:
                while not self.stopping and not self.waiting and not any(self.active) and self.pending is None:
                    self.wake.wait()
                if self.stopping and not any(self.active):
                    return
            try:
                self._tick()
            except Exception:  # a failed step must not leave its requests waiting forever
                traceback.print_exc()
                self._fail_all()

    def drain(self) -> None:
        """Run in this thread until every submitted request has finished."""
        while self.waiting or any(self.active):
            self._tick()

    def _tick(self) -> None:
        """Take swapped weights once no slot is busy, else fill free slots from the queue unless a swap waits;
        then decode one token in every busy slot."""
        with self.wake:
            if self.pending is not None and not any(self.active):
                (self.params, self.version), self.pending = self.pending, None
            admitted = [(s, self.waiting.popleft()) for s in range(self.n_slots)
                        if self.active[s] is None and self.waiting and self.pending is None]
        for s, request in admitted:
            self._admit(s, request)
        if any(self.active):
            self._step()

    def _admit(self, s: int, r: Request) -> None:
        if r.cancelled:
            r.done("cancelled")
            return
        bias_V = np.zeros(self.vocab_size, np.float32)
        for token, value in r.logit_bias.items():
            bias_V[token] = value
        settings = (jax.random.key(r.seed), jnp.float32(r.temperature), jnp.float32(r.top_p), bias_V)
        T = len(r.prompt)
        if self.specials is not None:  # the source, padded to src_block_size (the encoder masks padding)
            src_1L = np.full((1, self.cfg.src_block_size), self.specials["pad_id"], np.int32)
            src_1L[0, :T] = r.prompt
            self.state = _encode_slot(self.params, self.state, jnp.int32(s), src_1L, *settings, cfg=self.cfg,
                                      bos_id=self.specials["bos_id"])
        else:
            prompt_1P = np.zeros((1, bucket(T, self.cfg.block_size)), np.int32)
            prompt_1P[0, :T] = r.prompt
            self.state, scored = _prefill_slot(self.params, self.state, jnp.int32(s), prompt_1P, jnp.int32(T),
                                               *settings, cfg=self.cfg, score=r.prompt_logprobs is not None)
            if r.prompt_logprobs is not None:
                lp_P, (top_lp_PK, top_id_PK) = jax.device_get(scored)
                r.prompt_logprobs([(float(lp_P[i]), _pairs(top_id_PK[i], top_lp_PK[i])) for i in range(T - 1)])
        self.active[s], self.produced[s], r.version = r, 0, self.version
        if r.max_new_tokens == 0:
            self._retire(s, "length")

    def _step(self) -> None:
        self.state, tok_S, (logprob_S, top_SK) = _step(self.params, self.state, cfg=self.cfg, banned=self.banned,
                                                       vocab_limit=self.vocab_limit)
        tok_S, logprob_S, (top_lp_SK, top_id_SK) = jax.device_get((tok_S, logprob_S, top_SK))
        for s, r in enumerate(self.active):
            if r is None:
                continue
            if r.cancelled:
                self._retire(s, "cancelled")
                continue
            token = int(tok_S[s])
            r.emit(token, float(logprob_S[s]), _pairs(top_id_SK[s], top_lp_SK[s]))
            self.produced[s] += 1
            if token == self.eot_token and not r.ignore_eos:
                self._retire(s, "stop")
            elif self.produced[s] >= r.max_new_tokens:
                self._retire(s, "length")

    def _fail_all(self) -> None:
        with self.wake:
            failed, self.waiting = [*filter(None, self.active), *self.waiting], deque()
        self.active = [None] * self.n_slots
        for request in failed:
            request.done("error")

    def _retire(self, s: int, reason: str) -> None:
        request, self.active[s] = self.active[s], None
        assert request is not None
        request.done(reason)


def _pairs(ids_K: np.ndarray, logprobs_K: np.ndarray) -> list[tuple[int, float]]:
    return list(zip(ids_K.tolist(), logprobs_K.tolist(), strict=True))


def _logprobs(logits_XV: Array, tok_X: Array) -> tuple[Array, tuple[Array, Array]]:
    """Each row's log-probability of its token, and the TOP_LOGPROBS most likely (log-probabilities, ids)."""
    logp_XV = jax.nn.log_softmax(logits_XV.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp_XV, tok_X[:, None], axis=-1)[:, 0], jax.lax.top_k(logp_XV, TOP_LOGPROBS)


@functools.partial(jax.jit, static_argnames=("cfg", "score"), donate_argnames=("state",))
def _prefill_slot(params: Any, state: Slots, s: Array, prompt_1P: Array, T: Array, key: Array, temperature: Array,
                  top_p: Array, bias_V: Array, *, cfg: ModelConfig, score: bool
                  ) -> tuple[Slots, tuple[Array, tuple[Array, Array]] | None]:
    """Prefill a (right-padded) prompt into slot `s` and set its counters and settings; with `score`, also each
    prompt position's log-probability of the next prompt token (positions from T - 1 on are padding)."""
    logits_1PV, cache = _decode(cfg, params, prompt_1P, init_cache(cfg, 1), 0, False, last_only=False)
    cache = jax.tree.map(lambda all_, one: all_.at[s].set(one), state.cache, cache)
    state = Slots(cache, state.logits_SV.at[s].set(logits_1PV[0, T - 1]), state.length_S.at[s].set(T),
                  state.step_S.at[s].set(0), state.key_S.at[s].set(key), state.temperature_S.at[s].set(temperature),
                  state.top_p_S.at[s].set(top_p), state.bias_SV.at[s].set(bias_V))
    return state, _logprobs(logits_1PV[0, :-1], prompt_1P[0, 1:]) if score else None


@functools.partial(jax.jit, static_argnames=("cfg", "bos_id"), donate_argnames=("state",))
def _encode_slot(params: Any, state: Slots, s: Array, src_1L: Array, key: Array, temperature: Array, top_p: Array,
                 bias_V: Array, *, cfg: Seq2SeqConfig, bos_id: int) -> Slots:
    """Encode a source into slot `s` and feed the decoder its bos, as `seq2seq.generate` starts a row."""
    memory = seq2seq.encode(params, cfg, src_1L)
    logits_1V, cache = seq2seq._step(params, cfg, jnp.full((1,), bos_id, jnp.int32),
                                     init_cache(cfg.model, 1), jnp.int32(0), memory[1], memory[0])
    put = lambda all_, one: all_.at[s].set(one)
    return Slots(jax.tree.map(put, state.cache, cache), state.logits_SV.at[s].set(logits_1V[0]),
                 state.length_S.at[s].set(1), state.step_S.at[s].set(0), state.key_S.at[s].set(key),
                 state.temperature_S.at[s].set(temperature), state.top_p_S.at[s].set(top_p),
                 state.bias_SV.at[s].set(bias_V), jax.tree.map(put, state.memory, memory))


@functools.partial(jax.jit, static_argnames=("cfg", "banned", "vocab_limit"), donate_argnames=("state",))
def _step(params: Any, state: Slots, *, cfg: ModelConfig, banned: int | None, vocab_limit: int | None
          ) -> tuple[Slots, Array, tuple[Array, tuple[Array, Array]]]:
    """One token for every slot (idle slots compute too and are ignored), its log-probability and the top ones."""
    pick = functools.partial(_pick, banned=banned, vocab_limit=vocab_limit)
    tok_S = jax.vmap(pick)(state.logits_SV + state.bias_SV, state.key_S, state.step_S, state.temperature_S,
                           state.top_p_S)
    scored = _logprobs(state.logits_SV, tok_S)
    context = cfg.model.block_size if isinstance(cfg, Seq2SeqConfig) else cfg.block_size
    length_S = jnp.minimum(state.length_S, context - 1)  # an idle slot's length never runs past the cache

    def decode_one(tok: Array, cache: Any, index: Array, memory: Any) -> tuple[Array, Any]:
        if isinstance(cfg, Seq2SeqConfig):
            logits_1V, cache = seq2seq._step(params, cfg, tok[None], cache, index, memory[1], memory[0])
            return logits_1V[0], cache
        logits_11V, cache = _decode(cfg, params, tok[None, None], cache, index, False)
        return logits_11V[0, 0], cache

    logits_SV, cache = jax.vmap(decode_one)(tok_S, state.cache, length_S, state.memory)
    state = state._replace(cache=cache, logits_SV=logits_SV, length_S=state.length_S + 1, step_S=state.step_S + 1)
    return state, tok_S, scored


def generate_many(params: Any, cfg: ModelConfig | Seq2SeqConfig, prompts: Sequence[Sequence[int]], *,
                  max_new_tokens: int | Sequence[int], seeds: int | Sequence[int] = 0,
                  temperature: float | Sequence[float] = 1.0, top_p: float | Sequence[float] = 1.0,
                  eot_token: int | None = None, vocab_limit: int | None = None, slots: int = 8,
                  until: Callable[[int, list[int]], bool] | None = None, progress: bool = False,
                  specials: dict[str, int] | None = None) -> list[list[int]]:
    """New tokens for prompts of different lengths, `slots` at a time; every setting is one value or one per row.

    Row r samples what `generate(params, cfg, prompts[r], key=seeds[r], ...)` samples for it alone (an
    encoder-decoder's prompts are sources, with its `specials`: `seq2seq.sample`/`greedy` of the source). A row
    ends at `eot_token` (eos; included), after its max_new_tokens, or when `until(r, tokens so far)` says so.
    """
    n = len(prompts)
    per_row = lambda v: list(v) if isinstance(v, Sequence) else [v] * n
    settings = list(zip(per_row(max_new_tokens), per_row(seeds), per_row(temperature), per_row(top_p), strict=True))
    engine = Engine(params, cfg, slots=slots, max_waiting=n, eot_token=eot_token, vocab_limit=vocab_limit,
                    specials=specials)
    out: list[list[int]] = [[] for _ in range(n)]
    bar = tqdm(total=n, unit="request", disable=not progress, dynamic_ncols=True)
    for r, (prompt, (count, seed, temp, p)) in enumerate(zip(prompts, settings, strict=True)):
        engine.check(list(prompt), count, temp, p)
        request = Request(list(prompt), count, temperature=temp, top_p=p, seed=seed, emit=lambda *_: None,
                          done=lambda _: bar.update())

        def emit(token: int, _logprob: float, _top: list, r: int = r, request: Request = request) -> None:
            out[r].append(token)
            if until is not None and until(r, out[r]):
                request.cancelled = True

        request.emit = emit
        engine.submit(request)
    engine.drain()
    bar.close()
    return out
