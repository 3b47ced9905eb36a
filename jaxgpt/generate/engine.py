"""Continuous batching: a fixed number of cache slots that requests take, decode in, and free between chunks.

Each slot holds one request's KV cache (a batch-1 cache; the slots are stacked on a leading axis) with its own
length, step counter, key and sampling settings (`jaxgpt.generate.slots` has the device programs). A decode
chunk runs the model's batch-1 decode under `jax.vmap` for several steps in one on-device loop, so every request
decodes at its own position and one program serves any mix of requests: nothing recompiles when requests come
and go. Only the busy slots decode: they are kept at the front (a freed slot takes the last busy one), and a
chunk decodes the first `rows` slots, the next power of two (one program per power of two up to `slots`), over
the first `span` positions of their caches, the power of two (from `sampling.SHORTEST_CACHE`) that holds every
position they write by the chunk's end, so short requests read a short cache whatever the context. The
prompts a tick admits are prefilled into the first free slots together: those of one power-of-two bucket
(right-padded to it) in one call of a power-of-two number of rows, at most `PREFILL_TOKENS` positions (one
compile per bucket and row count; a prompt that asks for its log-probabilities alone); each request's first
token is picked there and sent at once. The padding's keys and values sit past the request's length,
invisible to it, and are overwritten as it decodes.

The device runs ahead of Python: chunk i + 1 is dispatched (JAX's asynchronous dispatch) before chunk i's tokens
are copied to the host and handed to their requests, so the host's bookkeeping overlaps the next chunk's
compute; at most one chunk is in flight unread. A slot that ends inside a chunk (end-of-text, a stop id, its
last token) stops there on the device; one that the host ends (a cancel, a stop string the server found) is
freed when its chunk is read, so a cancel costs at most the chunk in flight.

An encoder-decoder's prompt is its source: a slot also holds the source's mask and cross-attention keys and
values (the source padded to src_block_size with the padding id, which the encoder masks), and its decoder
starts from bos, as `seq2seq.generate` starts a row.

Sampling is `generate`'s (`jaxgpt.generate.slots`): a seeded request samples what `generate` samples for its
prompt alone. The context does not slide: prompt and new tokens must fit in the slots' positions (block_size).

What a server's clients ask for beyond sampling rides on the same programs: a request's `logit_bias` is a row
added to its logits before the pick (the reported log-probabilities stay the model's own, as vLLM's default),
`ignore_eos` keeps a request decoding past end-of-text, `stop_ids` end it at other tokens too (a chat model's
end-of-turn), and `prompt_logprobs` has the prefill, which computes every prompt position's logits anyway,
report each prompt token's log-probability (OpenAI's `echo` with `logprobs`); a request for 0 new tokens is
only that.

LoRA adapters (`adapters`, `jaxgpt.generate.adapters`) are stacked beside the base's kernels once; a request's
`adapter` names the one its rows decode with, so rows of different adapters and of the base share every chunk.

`swap` replaces the weights (same shapes: nothing recompiles) while the engine serves, as `jaxgpt serve --follow`
does with each new checkpoint of a run: from then on no request is admitted until the busy slots have
finished, so each request runs wholly on one set of weights, whose `version` it records.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.data.batches import bucket
from jaxgpt.errors import UserError
from jaxgpt.generate import seq2seq
from jaxgpt.generate.adapters import Stack, beside, columns_of
from jaxgpt.generate.checks import check_request
from jaxgpt.generate.decode_weights import decoding_weights
from jaxgpt.generate.sampling import cache_slots
from jaxgpt.generate.slots import (
    NO_TOKEN,
    TOP_LOGPROBS,
    Needs,
    Picked,
    Setting,
    decode_chunk,
    empty_slots,
    encode_slot,
    move_slot,
    prefill_slots,
)
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig, decoder_of

__all__ = ["TOP_LOGPROBS", "Engine", "Request", "check_request"]
CHUNK = 8  # tokens a decode chunk gives each busy slot (fewer once they all end)
# the most prompt positions (rows x bucket) one prefill call holds: what bounds its activations, and how long the
# busy slots wait for it (vLLM's max_num_batched_tokens has the same part)
PREFILL_TOKENS = 4096
# what `warm_up` compiles chunks for: sampled and greedy requests that ask for no log-probabilities or bias
WARM_NEEDS = (Needs(bias=False, noise=True, nucleus=False, scores=False),
              Needs(bias=False, noise=False, nucleus=False, scores=False))


@dataclasses.dataclass
class Request:
    """One generation. `emit(token, logprob, top, end)` is called from the engine's thread for every token, `end`
    saying whether it is an end token (end-of-text or a stop id: no text, whether it ended the request or
    `ignore_eos` decoded past it), and `done(reason)` once ("stop": end of text or a stop id, "length":
    max_new_tokens, "cancelled", "error": the engine failed). `prompt_logprobs`, when set, is called once after the
    prefill with (logprob, top) of prompt tokens 1.. (the first has no context); `logit_bias` maps token ids to what
    is added to their logits before each pick; `stop_ids` end the request like end-of-text (emitted, then
    done("stop")), whatever `ignore_eos` says. With `logprobs` False, emit's logprob is 0.0 and top empty, which
    spares the decode their cost."""

    prompt: list[int]
    max_new_tokens: int
    emit: Callable[[int, float, list[tuple[int, float]], bool], None]
    done: Callable[[str], None]
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    cancelled: bool = False
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    ignore_eos: bool = False
    stop_ids: Sequence[int] = ()
    logprobs: bool = True
    prompt_logprobs: Callable[[list[tuple[float, list[tuple[int, float]]]]], None] | None = None
    version: str | None = None  # set when admitted: the engine's `version`, the weights that answer it
    adapter: str | None = None  # the LoRA adapter it decodes with (one of the engine's `adapters`); None: the base


@dataclasses.dataclass
class _Busy:
    """A request in a slot, as the engine's thread knows it from the tokens read so far."""

    request: Request
    slot: int
    ends: frozenset[int]  # tokens that end it
    start: int  # positions its cache held after its prefill (the prompt's; an encoder-decoder's bos: 1)
    dispatched: int = 0  # decode steps dispatched for it: its cache holds at most start + dispatched positions
    produced: int = 0
    finished: bool = False


class Engine:
    """Decodes up to `slots` requests at once, `chunk` tokens per dispatch; `submit` from any thread, `run` in one
    thread of its own."""

    def __init__(self, params: Any, cfg: ModelConfig | Seq2SeqConfig, *, slots: int = 8, max_waiting: int = 64,
                 eot_token: int | None = None, vocab_limit: int | None = None,
                 specials: dict[str, int] | None = None, version: str | None = None, chunk: int = CHUNK,
                 adapters: Stack | None = None, positions: int | None = None) -> None:
        """`specials`: an encoder-decoder's pad_id, bos_id and eos_id (its run's meta["seq2seq"]); eos ends a row.
        `version` names the weights (each request admitted records it). `vocab_limit`: the tokenizer's vocabulary
        size; only a model vocabulary padded beyond it limits the picks (else it is dropped). `adapters`: LoRA
        adapters of a GPT's weights that requests may name. `positions`: what each slot's cache holds (None: the
        context; `generate_many` gives what its requests write, not 8k positions a slot for a short reply)."""
        if chunk < 1:
            raise UserError(f"chunk={chunk}: a decode chunk needs at least one step")
        self.n_slots, self.max_waiting, self.eot_token = slots, max_waiting, eot_token
        self.capacity = slots + max_waiting  # requests held at once, busy or waiting: what `submit` admits
        self.held = 0  # requests submitted and not yet done
        self.version, self.chunk, self.adapters = version, chunk, adapters
        self.pending: tuple[Any, str] | None = None  # weights `swap` gave, and their version
        memory, columns = None, 0  # an encoder-decoder's source state (one slot's shapes); adapters' rank columns
        if isinstance(cfg, Seq2SeqConfig):
            if specials is None:
                raise UserError("an encoder-decoder needs its pad, bos and eos ids (the run's meta['seq2seq'])")
            self.params, self.cfg, self.specials, self.eot_token = params, cfg, specials, specials["eos_id"]
            memory = jax.eval_shape(lambda: seq2seq.encode(params, cfg, jnp.zeros((1, cfg.src_block_size), jnp.int32)))
        else:
            self.params = beside(decoding_weights(params, cfg, None, output_major=False)[0], adapters)
            self.cfg, self.specials = cfg, None
            columns = adapters.width if adapters else 0
        self.given_cfg, self.decoder = cfg, decoder_of(cfg)  # what `swap`'s weights are laid out for; the decoder
        model = self.decoder
        self.positions = model.block_size if positions is None else cache_slots(model, positions, 1)  # `_span` rounds
        self._empty = lambda: jax.device_put(empty_slots(cfg, slots, memory, columns, self.positions), self.home)
        self.banned, self.vocab_size = model.pad_id, model.vocab_size
        self.vocab_limit = vocab_limit if vocab_limit is not None and vocab_limit < model.vocab_size else None
        leaf = jax.tree.leaves(self.params)[0]  # `_empty` commits to its device: warm-up compiles what calls use
        self.home = leaf.devices().pop() if isinstance(leaf, jax.Array) else jax.devices()[0]
        self.state = self._empty()
        self.active: list[_Busy | None] = [None] * slots  # the busy slots come first
        self.unread: deque[tuple[Callable[..., None], Any, Any]] = deque()  # dispatched, not yet read: oldest first
        self.waiting: deque[Request] = deque()
        self.wake, self.stopping = threading.Condition(), False

    def warm_up(self, needs: Sequence[Needs] = WARM_NEEDS, prompt_lengths: Sequence[int] | None = None,
                max_new_tokens: int | None = None) -> float:
        """Compile, before any request, the decode chunk of every row count (each power of two up to the slots)
        and span for each of `needs`, a decoder's prefill of every row count of the buckets of `prompt_lengths`
        (for prompts that ask for no log-probabilities), and the move that frees a slot of each span; seconds
        taken. Spans: those of requests with `prompt_lengths` and up to `max_new_tokens` new tokens (None: every
        length, up to the cache's positions). Without this the first time a load reaches a row count or span it
        stalls every busy request for that compile (on a GPU a server under 64 clients spent most of its time
        there). Call before `run`, on the empty state: every slot is done, so each chunk's loop ends at once, and
        the warm-up's prefills write no slot."""
        t = time.perf_counter()
        limits = {"banned": self.banned, "vocab_limit": self.vocab_limit}
        lengths = range(1, self.positions + 1) if prompt_lengths is None else prompt_lengths
        longest = self._span(max(map(self._cached, lengths)), max_new_tokens or self.positions)
        spans = sorted({min(longest, self._span(1, 1) << i) for i in range(longest.bit_length())})
        for rows in sorted({min(self.n_slots, 1 << i) for i in range(self.n_slots.bit_length() + 1)}):
            for span, need in itertools.product(spans, needs):
                self.state, _ = decode_chunk(self.params, self.state, cfg=self.cfg, rows=rows, span=span,
                                             steps=self.chunk, needs=need, **limits)
        nowhere = (self.n_slots, Request([0], 1, emit=lambda *_: None, done=lambda _: None))  # a row into no slot
        for P in sorted({bucket(n, self.cfg.block_size) for n in lengths} if self.specials is None else ()):
            for rows in (1 << i for i in range(self._prefill_rows(P, score=False).bit_length())):
                self._prefill([nowhere] * rows, P, score=False)
        for span in spans:  # slot 0, free already, freed again
            self.state = move_slot(self.state, np.int32(0), np.int32(0), span=span)
        jax.block_until_ready(self.state)
        return time.perf_counter() - t

    def check(self, prompt: list[int], max_new_tokens: int, temperature: float, top_p: float) -> None:
        check_request(self.cfg, prompt, max_new_tokens, temperature, top_p)
        if (written := self._cached(len(prompt)) + max_new_tokens - 1) > self.positions:
            raise UserError(f"the request writes {written} cache positions, past the engine's {self.positions}")

    def submit(self, *requests: Request) -> bool:
        """Queue checked requests, all or none: False when they do not all fit beside those held (the free slots
        and `max_waiting` more), so a server's request is refused whole, not left half queued."""
        with self.wake:
            if self.held + len(requests) > self.capacity:
                return False
            self.held += len(requests)
            self.waiting.extend(requests)
            self.wake.notify()
        return True

    def swap(self, params: Any, version: str) -> None:
        """Serve `params` (laid out as the constructor's, same shapes and dtypes) once the busy slots have
        finished; until then no request is admitted. A second swap before that replaces the first."""
        if self.specials is None:  # prepared here, in the caller's thread, not between the engine's chunks
            params = beside(decoding_weights(params, self.given_cfg, None, output_major=False)[0], self.adapters)
        with self.wake:
            self.pending = (params, version)
            self.wake.notify()

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()

    def run(self, after_tick: Callable[[], None] = lambda: None) -> None:
        """Admit, decode and retire requests until `stop`; the requests in flight finish first. `after_tick` is
        called on this thread after each tick: the server's engine process (`jaxgpt.serve.core`) sends what the
        tick's callbacks gathered to its front ends there, one message per tick rather than one per token."""
        while True:
            with self.wake:
                while (not self.stopping and not self.waiting and not any(self.active) and self.pending is None
                       and not self.unread):
                    self.wake.wait()
                if self.stopping and not any(self.active) and not self.unread:
                    return
            try:
                self._tick()
            except Exception:  # a failed chunk must not leave its requests waiting forever
                traceback.print_exc()
                self._fail_all()
            after_tick()

    def drain(self) -> None:
        """Run in this thread until every submitted request has finished."""
        while self.waiting or any(self.active) or self.unread:
            self._tick()

    def _tick(self) -> None:
        """Take swapped weights once no slot is busy, else fill free slots from the queue unless a swap waits;
        dispatch a chunk for the busy slots, then read what was dispatched before it. Waiting requests that were
        cancelled leave the queue at once, not when they reach a slot."""
        with self.wake:
            if self.pending is not None and not any(self.active):
                (self.params, self.version), self.pending = self.pending, None
            dropped = [r for r in self.waiting if r.cancelled]
            if dropped:
                self.waiting = deque(r for r in self.waiting if not r.cancelled)
            free = self.active.count(None)
            admitted = [self.waiting.popleft() for _ in range(free) if self.waiting and self.pending is None]
        for request in dropped:
            self._end(request, "cancelled")
        self._admit(admitted)
        busy = any(self.active)
        if busy:
            self._step()
        self._read(keep=1 if busy else 0)

    def _read(self, keep: int) -> None:
        """Hand the oldest dispatched results to their requests until `keep` remain in flight."""
        while len(self.unread) > keep:
            take, whom, out = self.unread.popleft()
            take(whom, jax.device_get(out))

    def _admit(self, requests: list[Request]) -> None:
        """Dispatch the prefills of the requests a tick admits into the first free slots (their first tokens are
        read with the chunks): a decoder's prompts of one bucket together, in calls of up to `_prefill_rows`
        rows; an encoder-decoder's sources one by one."""
        free = iter([s for s, b in enumerate(self.active) if b is None])
        groups: dict[tuple[int, bool], list[Request]] = {}
        for r in requests:
            if r.cancelled:
                self._end(r, "cancelled")
            elif self.specials is not None:
                self._encode(next(free), r)
            else:
                key = (bucket(len(r.prompt), self.cfg.block_size), r.prompt_logprobs is not None)
                groups.setdefault(key, []).append(r)
        for (P, score), group in groups.items():
            n = self._prefill_rows(P, score)
            for i in range(0, len(group), n):
                placed = [(next(free), r) for r in group[i:i + n]]
                out = self._prefill(placed, P, score)
                self.unread.append((self._take_first, [self._place(s, r) for s, r in placed], out))

    def _prefill(self, placed: list[tuple[int, Request]], P: int, score: bool) -> tuple[Picked, Any]:
        """Dispatch one call prefilling each (slot, request) of `placed`, their prompts right-padded to P, in a
        power of two of rows (the padding rows repeat the first request into no slot); its first tokens and
        scores."""
        rows = 1 << (len(placed) - 1).bit_length()
        requests = [r for _, r in placed] + [placed[0][1]] * (rows - len(placed))
        prompt_NP = np.zeros((rows, P), np.int32)
        for i, r in enumerate(requests):
            prompt_NP[i, :len(r.prompt)] = r.prompt
        s_N = np.array([s for s, _ in placed] + [self.n_slots] * (rows - len(placed)), np.int32)
        T_N = np.array([len(r.prompt) for r in requests], np.int32)
        self.state, first, scored = prefill_slots(self.params, self.state, s_N, prompt_NP, T_N,
                                                  self._settings(requests), cfg=self.cfg, score=score,
                                                  banned=self.banned, vocab_limit=self.vocab_limit)
        return first, scored

    def _encode(self, s: int, r: Request) -> None:
        """Dispatch an encoder-decoder's source into slot `s` (padded to src_block_size: the encoder masks it)."""
        src_1L = np.full((1, self.cfg.src_block_size), self.specials["pad_id"], np.int32)
        src_1L[0, :len(r.prompt)] = r.prompt
        self.state, first = encode_slot(self.params, self.state, np.int32(s), src_1L, self._settings([r]),
                                        cfg=self.cfg, bos_id=self.specials["bos_id"], banned=self.banned,
                                        vocab_limit=self.vocab_limit)
        self.unread.append((self._take_first, [self._place(s, r)], (first, None)))

    def _place(self, s: int, r: Request) -> _Busy:
        """Slot `s` is now `r`'s, on the weights served now."""
        self.active[s], r.version = _Busy(r, s, self._ends(r), self._cached(len(r.prompt))), self.version
        return self.active[s]

    def _prefill_rows(self, P: int, score: bool) -> int:
        """The most rows a prefill of bucket P holds: a power of two up to the slots and `PREFILL_TOKENS`
        positions; one to score prompts (every position's logits: P x vocabulary floats a row)."""
        most = 1 if score else min(self.n_slots, max(1, PREFILL_TOKENS // P))
        return 1 << (most.bit_length() - 1)

    def _ends(self, r: Request) -> frozenset[int]:
        """The tokens that end `r`: its stop ids, and end-of-text unless it ignores it."""
        return frozenset(r.stop_ids) | ({self.eot_token} if self.eot_token is not None and not r.ignore_eos else set())

    def _settings(self, requests: list[Request]) -> Setting:
        """The requests' rows of the per-slot settings (`slots.Setting`)."""
        bias_NV, end_NV = (np.zeros((len(requests), self.vocab_size), t) for t in (np.float32, bool))
        for i, r in enumerate(requests):
            bias_NV[i, list(r.logit_bias)] = list(r.logit_bias.values())
            end_NV[i, list(self._ends(r))] = True
        adapter_NR = None if self.adapters is None else np.stack([columns_of(self.adapters, r.adapter)
                                                                  for r in requests])
        column = lambda field, dtype: np.array([getattr(r, field) for r in requests], dtype)
        return Setting(jnp.stack([jax.random.key(r.seed) for r in requests]), column("temperature", np.float32),
                       column("top_p", np.float32), column("max_new_tokens", np.int32), bias_NV, end_NV, adapter_NR)

    def _step(self) -> None:
        """Dispatch a chunk for the busy slots (rows: the next power of two), with what their settings need."""
        busy = [b.request for b in self.active if b is not None]
        rows = min(self.n_slots, 1 << (len(busy) - 1).bit_length())
        sampled = [r for r in busy if r.temperature > 0]
        needs = Needs(bias=any(r.logit_bias for r in busy), noise=bool(sampled),
                      nucleus=any(r.top_p < 1 for r in sampled), scores=any(r.logprobs for r in busy))
        span = max(self._span(b.start, min(b.request.max_new_tokens, b.dispatched + self.chunk + 1))
                   for b in self.active[:rows] if b is not None)
        for b in self.active[:rows]:
            if b is not None:
                b.dispatched += self.chunk
        self.state, out = decode_chunk(self.params, self.state, cfg=self.cfg, rows=rows, span=span,
                                       steps=self.chunk, needs=needs, banned=self.banned, vocab_limit=self.vocab_limit)
        self.unread.append((self._take_chunk, self.active[:rows], out))

    def _span(self, start: int, new_tokens: int) -> int:
        """The cache positions a chunk attends over (and a move copies) for a request with `start` positions cached
        and up to `new_tokens` picked by the chunk's end: `cache_slots`'s power of two, so that short requests read
        a short prefix of the cache (the reads grow with the span, not with block_size) with a few programs."""
        return min(cache_slots(self.decoder, start, new_tokens), self.positions)

    def _cached(self, prompt_length: int) -> int:
        """The cache positions a request's prefill fills: its prompt, or an encoder-decoder's bos (the source
        lives in the encoder's memory, not in the decoder's cache)."""
        return 1 if self.specials is not None else prompt_length

    def _take_first(self, rows: list[_Busy], out: tuple[Picked, Any]) -> None:
        """A prefill's results, row by row: the prompt's log-probabilities when asked for, and the first token."""
        scored, first = out[1], Picked(*(None if x is None else x[:, None] for x in out[0]))  # a chunk of one step
        for b, busy in enumerate(rows):
            r = busy.request
            if scored is not None:
                lp_NP, (top_lp_NPK, top_id_NPK) = scored
                r.prompt_logprobs([(float(lp_NP[b, i]), _pairs(top_id_NPK[b, i], top_lp_NPK[b, i]))
                                   for i in range(len(r.prompt) - 1)])
            if r.max_new_tokens == 0:
                self._retire(busy, "length")
            else:
                self._give(busy, first, b, 0)

    def _take_chunk(self, rows: list[_Busy | None], out: Picked) -> None:
        """A chunk's tokens, row by row, to the requests that were in those rows when it was dispatched."""
        for b, busy in enumerate(rows):
            k = 0
            while busy is not None and not busy.finished and k < out.tok.shape[1] and out.tok[b, k] != NO_TOKEN:
                self._give(busy, out, b, k)
                k += 1

    def _give(self, busy: _Busy, out: Picked, b: int, k: int) -> None:
        """Token k of row b to its request (unless cancelled), and its end when that token ends it."""
        r = busy.request
        if r.cancelled:
            self._retire(busy, "cancelled")
            return
        token = int(out.tok[b, k])
        ended = token in busy.ends
        end = ended or token == self.eot_token  # end-of-text is no text, also where ignore_eos decodes past it
        if out.logprob is None:
            r.emit(token, 0.0, [], end)
        else:
            r.emit(token, float(out.logprob[b, k]), _pairs(out.top_id[b, k], out.top_logprob[b, k]), end)
        busy.produced += 1
        if ended:
            self._retire(busy, "stop")
        elif busy.produced >= r.max_new_tokens:
            self._retire(busy, "length")

    def _retire(self, busy: _Busy, reason: str) -> None:
        """End a request and free its slot: the last busy slot moves into it, keeping the busy ones in front."""
        busy.finished = True
        last = self.n_slots - self.active.count(None) - 1
        moved, self.active[last] = self.active[last], None
        self.state = move_slot(self.state, np.int32(last), np.int32(busy.slot),
                               span=self._span(moved.start, moved.dispatched + 1))
        if moved is not busy:
            self.active[busy.slot], moved.slot = moved, busy.slot
        self._end(busy.request, reason)

    def _end(self, request: Request, reason: str) -> None:
        """A request is done: its place frees for `submit`."""
        with self.wake:
            self.held -= 1
        request.done(reason)

    def _fail_all(self) -> None:
        with self.wake:
            failed, self.waiting = [*(b.request for b in self.active if b is not None), *self.waiting], deque()
        self.active, self.unread, self.state = [None] * self.n_slots, deque(), self._empty()
        for request in failed:
            self._end(request, "error")


def _pairs(ids_K: np.ndarray, logprobs_K: np.ndarray) -> list[tuple[int, float]]:
    return list(zip(ids_K.tolist(), logprobs_K.tolist(), strict=True))
