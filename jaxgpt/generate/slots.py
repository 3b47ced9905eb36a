"""The continuous-batching engine's device programs (`jaxgpt.generate.engine` drives them from its thread).

Every slot's state lives on the device, stacked on a leading slot axis (`Slots`). Three programs change it:

* `prefill_slots` / `encode_slot`: requests' prompts (a GPT's, several at once, right-padded to one
  power-of-two bucket) or a source (an encoder-decoder's) go into free slots, and each request's first token is
  picked there, so the server can send it as soon as the prefill is done instead of one decode chunk later.
* `decode_chunk`: up to `steps` tokens for the first `rows` slots (a power of two: the busy slots are kept at the
  front, so one client decodes one row, not all of them), in one on-device loop, with no return to Python
  between tokens, attending over the first `span` positions of their caches (a power of two that holds what they
  fill: a decode step reads its row's cache, which for short requests on a long context costs more than the
  weights when many rows decode). A slot stops advancing at its end (a token of its end set: end-of-text unless
  ignored, a stop id; or its last token); on CPUs the loop stops early once every row has ended, elsewhere it
  runs its `steps` (a known trip count: `decode_weights.token_loop`).
* `move_slot`: a busy slot copied onto a freed one, which keeps the busy slots at the front: its cache's first
  `span` positions only, those its request wrote (a copy of every position cost more than the decoding once the
  context is long).

A slot holds the token it picked last, not yet fed to the model: a decode step feeds it at the slot's length and
picks the next from the logits that come out. Token i of a request draws its noise from `fold_in(key, i)`,
greedy at temperature 0, top-p only below 1: `generate`'s sampling, so a seeded request samples what `generate`
samples for its prompt alone (up to float rounding in the different batching of the products).

With LoRA adapters served (`jaxgpt.generate.adapters`), each slot also holds the mask of its request's adapter's
rank columns (`adapter_SR`), and the prefill and every decode step lay that row's `rows` beside the stacked adapters
in the parameters, so one program decodes rows of any mix of adapters and of the base.

What the busy slots' settings need (`Needs`: a logit bias, noise, the nucleus sort, log-probabilities) is
static: a chunk of greedy requests draws no noise, one without biases adds no (rows, V) bias, and one whose
clients asked for no log-probabilities skips the log-softmax and top-k; each combination compiles once.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxgpt.generate import seq2seq
from jaxgpt.generate.adapters import with_rows
from jaxgpt.generate.decode_weights import token_loop
from jaxgpt.generate.sampling import _decode
from jaxgpt.generate.strategies import gumbel_noise, pick_tokens
from jaxgpt.model.attention import init_cache
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig, decoder_of
from jaxgpt.ops.loss import target_logit

Array = jax.Array
TOP_LOGPROBS = 5  # the most alternatives a request may ask for (OpenAI's completions allow 5)
NO_TOKEN = -1  # in a chunk's tokens: that row decoded nothing at that step (it had ended)


class Slots(NamedTuple):
    """The device state of every slot (leading axis: the slot)."""

    cache: Any
    tok_S: Array  # the token each slot picked last, fed to the model by the next decode step
    length_S: Array  # where that token goes: how many tokens the slot's cache holds
    step_S: Array  # tokens picked so far; the next pick draws its noise from fold_in(key, step)
    left_S: Array  # tokens still to pick
    done_S: Array  # ended (or free): the slot no longer advances
    key_S: Array
    temperature_S: Array
    top_p_S: Array
    bias_SV: Array  # each slot's logit_bias, added to its logits before the pick
    end_SV: Array  # bool: the tokens that end each slot (end-of-text unless ignored, its stop ids)
    memory: Any = None  # encoder-decoders: each slot's source mask (S, 1, L) and cross-attention keys/values
    adapter_SR: Any = None  # with LoRA adapters served: each slot's mask over their rank columns (0s: the base)


class Setting(NamedTuple):
    """The per-slot settings of the N requests a `prefill_slots` call starts (one for `encode_slot`), each
    field with a leading axis of the N rows."""

    key: Array
    temperature: Array
    top_p: Array
    max_new_tokens: Array
    bias_NV: Array
    end_NV: Array
    adapter_NR: Array | None = None  # with adapters served: each request's mask (`adapters.columns_of`)


class Needs(NamedTuple):
    """What a chunk's busy slots need computed (a static argument: one program per combination)."""

    bias: bool = True  # some slot has a logit_bias
    noise: bool = True  # some slot samples (temperature above 0)
    nucleus: bool = True  # some slot samples with top_p below 1
    scores: bool = True  # some slot's client wants log-probabilities


class Picked(NamedTuple):
    """Tokens of a prefill (1,) or a chunk (rows, steps) and, when asked for, their log-probabilities and the
    TOP_LOGPROBS most likely alternatives (log-probabilities and ids, with a trailing axis of TOP_LOGPROBS)."""

    tok: Array
    logprob: Array | None = None
    top_logprob: Array | None = None
    top_id: Array | None = None


def empty_slots(cfg: ModelConfig | Seq2SeqConfig, slots: int, memory: Any = None, adapter_columns: int = 0,
                positions: int | None = None) -> Slots:
    """Every slot free (ended), its cache of `positions` (None: block_size) zeroed; `memory`: the shapes of one
    slot's source state (an encoder-decoder's); `adapter_columns`: the rank columns of the LoRA adapters served
    (`adapters.Stack.width`; 0: none, no adapter state)."""
    model = decoder_of(cfg)
    V = model.vocab_size
    per_slot = lambda tree: jax.tree.map(lambda c: jnp.zeros((slots, *c.shape), c.dtype), tree)
    cache = per_slot(init_cache(model, 1, positions))
    zeros = lambda: jnp.zeros(slots, jnp.int32)  # a buffer each: the programs donate the state
    return Slots(cache, zeros(), zeros(), zeros(), zeros(), jnp.ones(slots, bool),
                 jax.random.split(jax.random.key(0), slots), jnp.zeros(slots, jnp.float32),
                 jnp.ones(slots, jnp.float32), jnp.zeros((slots, V), jnp.float32), jnp.zeros((slots, V), bool),
                 per_slot(memory),
                 jnp.zeros((slots, adapter_columns), jnp.float32) if adapter_columns else None)


def row_noise(key_B: Array, step_B: Array, V: int) -> Array:
    """Each row's Gumbel noise (B, V) for its step: `generate`'s (`gumbel_noise`), drawn per row."""
    return jax.vmap(lambda key, step: gumbel_noise(key, step, (1, V))[0])(key_B, step_B)


def pick_rows(logits_BV: Array, gumbel_BV: Array | None, temperature_B: Array, top_p_B: Array, nucleus: bool,
              banned: int | None, vocab_limit: int | None) -> Array:
    """`generate`'s choice for each row: greedy at temperature 0 (or without noise), top-p only below 1 (with
    `nucleus`: False when no row has a top_p below 1, which spares the sort)."""
    limits = {"banned": banned, "vocab_limit": vocab_limit}
    greedy_B = pick_tokens(logits_BV, None, **limits)
    if gumbel_BV is None:
        return greedy_B
    temperature_B1 = jnp.maximum(temperature_B, 1e-6)[:, None]
    tok_B = pick_tokens(logits_BV, gumbel_BV, temperature_B1, **limits)
    if nucleus:
        nucleus_B = pick_tokens(logits_BV, gumbel_BV, temperature_B1, None, top_p_B[:, None], **limits)
        tok_B = jnp.where(top_p_B < 1, nucleus_B, tok_B)
    return jnp.where(temperature_B == 0, greedy_B, tok_B)


def logprobs(logits_XV: Array, tok_X: Array) -> tuple[Array, tuple[Array, Array]]:
    """Each row's log-probability of its token, and the TOP_LOGPROBS most likely (log-probabilities, ids)."""
    logp_XV = jax.nn.log_softmax(logits_XV.astype(jnp.float32), axis=-1)
    return target_logit(logp_XV, tok_X), jax.lax.top_k(logp_XV, TOP_LOGPROBS)


def _start(state: Slots, s_N: Array, cache: Any, logits_NV: Array, length_N: Array, setting: Setting,
           memory: Any, banned: int | None, vocab_limit: int | None) -> tuple[Slots, Picked]:
    """Put N prefilled requests into slots `s_N` (a slot index past the last: a padding row, dropped) and pick
    each one's first token (step 0) from its prompt's last logits. `cache`, `memory` and `setting` have a
    leading axis of the N rows."""
    N, V = logits_NV.shape

    def pick(noise: bool, nucleus: bool) -> Array:
        noise_NV = row_noise(setting.key, jnp.zeros(N, jnp.int32), V) if noise else None
        return pick_rows(logits_NV + setting.bias_NV, noise_NV, setting.temperature, setting.top_p, nucleus, banned,
                         vocab_limit)

    # the noise and the nucleus sort (of the whole vocabulary) only when some row uses them, chosen on the
    # device: one program serves every mix of requests
    sampled_N = setting.temperature > 0
    tok_N = jax.lax.switch(jnp.any(sampled_N).astype(jnp.int32) + jnp.any(sampled_N & (setting.top_p < 1)),
                           [lambda: pick(False, False), lambda: pick(True, False), lambda: pick(True, True)])
    lp_N, (top_lp_NK, top_id_NK) = logprobs(logits_NV, tok_N)
    done_N = (setting.max_new_tokens <= 1) | jnp.take_along_axis(setting.end_NV, tok_N[:, None], axis=1)[:, 0]
    put = lambda whole, new: whole.at[s_N].set(new, mode="drop")
    # each cache into a prefix of its slot's positions
    put_cache = lambda whole, new: whole.at[s_N, ..., :new.shape[-2], :].set(new, mode="drop")
    state = Slots(jax.tree.map(put_cache, state.cache, cache), put(state.tok_S, tok_N),
                  put(state.length_S, length_N), put(state.step_S, jnp.ones(N, jnp.int32)),
                  put(state.left_S, setting.max_new_tokens - 1), put(state.done_S, done_N),
                  put(state.key_S, setting.key), put(state.temperature_S, setting.temperature),
                  put(state.top_p_S, setting.top_p), put(state.bias_SV, setting.bias_NV),
                  put(state.end_SV, setting.end_NV), jax.tree.map(put, state.memory, memory),
                  jax.tree.map(put, state.adapter_SR, setting.adapter_NR))
    return state, Picked(tok_N, lp_N, top_lp_NK, top_id_NK)


@functools.partial(jax.jit, static_argnames=("cfg", "score", "banned", "vocab_limit"), donate_argnames=("state",))
def prefill_slots(params: Any, state: Slots, s_N: Array, prompt_NP: Array, T_N: Array, setting: Setting, *,
                  cfg: ModelConfig, score: bool, banned: int | None, vocab_limit: int | None
                  ) -> tuple[Slots, Picked, tuple[Array, tuple[Array, Array]] | None]:
    """Prefill N (right-padded) prompts of one bucket into slots `s_N` (past the last slot: a padding row, whose
    results go nowhere) and pick each one's first token; with `score`, also each prompt position's
    log-probability of the next prompt token (positions from T - 1 on are padding). The engine prefills the
    prompts a tick admits together: one call of N rows costs little more than one of a row where the weights'
    reads dominate, as they do for short prompts. Each prompt attends over a cache of its own length, which then
    fills its slot's first positions: the slot's later positions keep an earlier request's keys, which its
    decode steps never see (they read positions below its length) and overwrite as it goes."""
    (N, P), scanned = prompt_NP.shape, cfg.scan_layers
    # Every position's logits only to score the prompts; else each one's position T - 1 alone (the vocabulary's
    # head over every position was the largest product of a SmolLM2 prefill, docs/benchmarks.md)
    logits_NXV, cache = _decode(cfg, with_rows(params, setting.adapter_NR, cfg), prompt_NP, init_cache(cfg, N, P), 0,
                                False, logits_at=None if score else T_N - 1)
    # each row's cache as a slot holds it: batch-1, rows leading (the batch axis follows the layers' when scanned)
    cache = jax.tree.map(lambda c: jnp.expand_dims(jnp.moveaxis(c, int(scanned), 0), int(scanned) + 1), cache)
    last_NV = jnp.take_along_axis(logits_NXV, (T_N - 1)[:, None, None], axis=1)[:, 0] if score else logits_NXV[:, 0]
    state, first = _start(state, s_N, cache, last_NV, T_N, setting, None, banned, vocab_limit)
    return state, first, jax.vmap(logprobs)(logits_NXV[:, :-1], prompt_NP[:, 1:]) if score else None


@functools.partial(jax.jit, static_argnames=("cfg", "bos_id", "banned", "vocab_limit"), donate_argnames=("state",))
def encode_slot(params: Any, state: Slots, s: Array, src_1L: Array, setting: Setting, *, cfg: Seq2SeqConfig,
                bos_id: int, banned: int | None, vocab_limit: int | None) -> tuple[Slots, Picked]:
    """Encode a source into slot `s`, feed the decoder its bos (as `seq2seq.generate` starts a row) and pick the
    first token."""
    memory = seq2seq.encode(params, cfg, src_1L)
    logits_1V, cache = seq2seq._step(params, cfg, jnp.full((1,), bos_id, jnp.int32), init_cache(cfg.model, 1),
                                     jnp.int32(0), memory[1], memory[0])
    one_row = lambda x: x[None]  # the slots hold batch-1 caches and memories: a leading axis of one row
    return _start(state, s[None], jax.tree.map(one_row, cache), logits_1V, jnp.ones(1, jnp.int32), setting,
                  jax.tree.map(one_row, memory), banned, vocab_limit)


@functools.partial(jax.jit, static_argnames=("span",), donate_argnames=("state",))
def move_slot(state: Slots, src: Array, dst: Array, *, span: int) -> Slots:
    """Slot `src` copied onto `dst`, the first `span` positions of its cache (which must hold every position its
    request wrote: the rest are stale, never read), and `src` freed (with src == dst: that slot freed)."""
    cache = jax.tree.map(lambda c: c.at[dst, ..., :span, :].set(c[src, ..., :span, :]), state.cache)
    state = jax.tree.map(lambda x: x.at[dst].set(x[src]), state._replace(cache=None))
    return state._replace(cache=cache, done_S=state.done_S.at[src].set(True))


@functools.partial(jax.jit, static_argnames=("cfg", "rows", "span", "steps", "needs", "banned", "vocab_limit"),
                   donate_argnames=("state",))
def decode_chunk(params: Any, state: Slots, *, cfg: ModelConfig | Seq2SeqConfig, rows: int, span: int, steps: int,
                 needs: Needs, banned: int | None, vocab_limit: int | None) -> tuple[Slots, Picked]:
    """Up to `steps` tokens for each of the first `rows` slots, attending over the first `span` positions of
    their caches, which must hold every position the busy rows write in this chunk (the rest of each cache is
    neither read nor written); tokens of rows that had ended are NO_TOKEN."""
    part = jax.tree.map(lambda x: x[:rows], state)
    part = part._replace(cache=jax.tree.map(lambda c: c[..., :span, :], part.cache))
    out = Picked(jnp.full((rows, steps), NO_TOKEN, jnp.int32))
    if needs.scores:
        out = out._replace(logprob=jnp.zeros((rows, steps), jnp.float32),
                           top_logprob=jnp.zeros((rows, steps, TOP_LOGPROBS), jnp.float32),
                           top_id=jnp.zeros((rows, steps, TOP_LOGPROBS), jnp.int32))
    advance = functools.partial(_advance, params, cfg=cfg, needs=needs, banned=banned, vocab_limit=vocab_limit)
    # The noise of all the chunk's steps at once: a live row's step counter advances by one per step, so step i
    # of the chunk draws row b's noise for its step step_S[b] + i. One draw instead of one per step matters on
    # CPUs, where jax runs the random bits' rounds as a loop of small ops each time.
    V = part.bias_SV.shape[-1]
    noise_RNV = (jax.vmap(lambda i: row_noise(part.key_S, part.step_S + i, V), out_axes=1)(jnp.arange(steps))
                 if needs.noise else None)

    def one(i: Array, carry: tuple[Slots, Picked], _: Array | bool) -> tuple[Slots, Picked]:
        st, out = carry  # a step after every row ended (`token_loop`'s uncommitted one) changes none: `_advance`
        st, picked = advance(st, None if noise_RNV is None else noise_RNV[:, i])
        put = lambda whole, new: None if whole is None else jax.lax.dynamic_update_index_in_dim(whole, new, i, 1)
        return st, Picked(*map(put, out, picked))

    window = min(steps, span)  # a row writes at most this many positions, from its length on (clipped to the span)
    start_R = jnp.minimum(part.length_S, span - window)
    part, out = token_loop(steps, lambda carry: ~jnp.all(carry[0].done_S), one, (part, out))
    # Back into the slots: each row's window of positions, not the whole span (a copy of every busy row's cache,
    # which on CPUs cost more than a tenth of a 16-row chunk).
    row_RW, pos_RW = jnp.arange(rows)[:, None], start_R[:, None] + jnp.arange(window)
    cache = jax.tree.map(lambda whole, p: whole.at[row_RW, ..., pos_RW, :].set(p[row_RW, ..., pos_RW, :]),
                         state.cache, part.cache)
    rest = jax.tree.map(lambda whole, p: whole.at[:rows].set(p), state._replace(cache=None), part._replace(cache=None))
    return rest._replace(cache=cache), out


def _advance(params: Any, st: Slots, noise_BV: Array | None, *, cfg: ModelConfig | Seq2SeqConfig, needs: Needs,
             banned: int | None, vocab_limit: int | None) -> tuple[Slots, Picked]:
    """One decode step of every row: feed its last token, pick the next (with each row's noise for its step, None
    when no row samples); rows that had ended stay as they are (their cache takes a write past their tokens, which
    nothing reads) and report NO_TOKEN."""
    span = jax.tree.leaves(st.cache)[0].shape[-2]
    index_B = jnp.minimum(st.length_S, span - 1)  # a free slot's (stale) length never runs past the cache

    def decode_one(tok: Array, cache: Any, index: Array, memory: Any, adapter_R: Array | None) -> tuple[Array, Any]:
        if isinstance(cfg, Seq2SeqConfig):
            logits_1V, cache = seq2seq._step(params, cfg, tok[None], cache, index, memory[1], memory[0])
            return logits_1V[0], cache
        logits_11V, cache = _decode(cfg, with_rows(params, None if adapter_R is None else adapter_R[None], cfg),
                                    tok[None, None], cache, index, False)
        return logits_11V[0, 0], cache

    logits_BV, cache = jax.vmap(decode_one)(st.tok_S, st.cache, index_B, st.memory, st.adapter_SR)
    tok_B = pick_rows(logits_BV + st.bias_SV if needs.bias else logits_BV, noise_BV, st.temperature_S, st.top_p_S,
                      needs.nucleus, banned, vocab_limit)
    live_B = ~st.done_S
    ends_B = jnp.take_along_axis(st.end_SV, tok_B[:, None], axis=1)[:, 0] | (st.left_S <= 1)
    step_B = live_B.astype(jnp.int32)
    st = st._replace(cache=cache, tok_S=jnp.where(live_B, tok_B, st.tok_S), length_S=st.length_S + step_B,
                     step_S=st.step_S + step_B, left_S=st.left_S - step_B, done_S=st.done_S | (live_B & ends_B))
    picked = Picked(jnp.where(live_B, tok_B, NO_TOKEN))
    if needs.scores:
        lp_B, (top_lp_BK, top_id_BK) = logprobs(logits_BV, tok_B)
        picked = Picked(picked.tok, lp_B, top_lp_BK, top_id_BK)
    return st, picked
