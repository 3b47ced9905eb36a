"""Text generation: a key/value cache and a compiled decode loop around the sampling strategies.

`generate` is the one library call: prefill the prompt into a preallocated cache with one `GPT.decode` call, then run
a `lax.while_loop` inside `jax.jit` that samples one token per step for the whole batch and feeds it back through the
cache. Nothing returns to Python between tokens, so a token costs one small forward pass whatever the context length.
`stream` runs the same loop in chunks and yields the tokens of each chunk as it finishes (the CLI prints them as they
arrive); both give identical tokens. A token reads every weight and every cache slot, so both are laid out for that:
the cache has only as many slots as the generation needs (`cache_slots`, at most block_size), and one row on a CPU or
a GPU decodes from output-major kernels (`decoding_weights`).

Tokens are chosen by `jaxgpt.generate.strategies` (greedy, temperature, top-k, top-p). The noise of step i depends
only on the seed and i, so a seed gives the same tokens whether the loop runs in one call, in chunks, or without a
cache (`sampling_reference.generate_uncached`).

Contexts longer than `block_size` (the windowed rule)
-----------------------------------------------------
Seed 000 conditions each new token on the last `block_size` tokens. Positions are absolute (a learned or sinusoidal
table indexed 0..block_size-1), so once the window slides, every kept token sits at a new position and its cached
keys/values are stale; they cannot be reused. jaxgpt therefore moves the window in jumps. The window, `seq[start:]`,
starts as the prompt's last `block_size` tokens (all of it if shorter) and grows by one token per step while it fits;
when a new token would make it `block_size + 1` long, `start` advances by `window_shift`, and the `block_size + 1 -
window_shift` tokens it keeps are re-prefilled into the cache at positions 0.. with one `decode` call.
`window_shift=1` is seed 000's rule exactly, at the price of a re-prefill on every step once the context is full; a
larger shift re-prefills every `window_shift` tokens, the window then holding between `block_size + 1 - window_shift`
and `block_size` tokens. The default, `block_size // 2`, keeps at least half the context at about one prefilled token
per new token (block_size // 4: three, measurably slower on small models). Whatever the shift, the cached result
equals `generate_uncached`, which reruns the model on the same window at every step.

Two decoders, each for its inputs
---------------------------------
The continuous-batching engine (`engine`: the server, RL's rollouts, `jaxgpt sample` on a requests file) samples the
same tokens for a seed, but its prompt and new tokens must fit in block_size (no window: the quick start samples 500
tokens from a 256-token context) and it has no top-k, logits or bfloat16 decoding. One prompt tends to decode faster
here (output-major kernels, no trip to the host every 8 tokens), ragged prompts there. Tokens/s here vs there
(benchmarks/bench_decoders.py, two runs, a shared 2-core CPU): 4x4x128, one prompt 11,130 / 9,459 vs 5,264 / 2,491, 16
ragged 4,092 / 3,804 vs 5,008 / 4,683; 6x6x384, one prompt 203 / 311 vs 229 / 205, 16 ragged 240 / 208 vs 477 / 544.

End of text and padding ids
---------------------------
With `eot_token` set, a row that samples it is finished: every later token of that row is `eot_token` too, and the
loop stops as soon as every row has finished. A model whose config has a `pad_id` treats that id as padding in its
full forward pass; the sampler never produces it and prompts may not contain it, so cached and uncached computations
see the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.data.batches import bucket
from jaxgpt.data.tokenizer_base import out_of_range
from jaxgpt.errors import UserError
from jaxgpt.generate.decode_weights import (
    DECODE_OPTIONS,
    decoding_weights,
    kernel_storage,
    output_major_for,
    token_loop,
    trip_tokens,
)
from jaxgpt.generate.strategies import NOISE_BLOCK_ELEMENTS, noise_block, pick_tokens
from jaxgpt.model.attention import init_cache
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import GPT

Array = jax.Array
PromptLike = Sequence[int] | Sequence[Sequence[int]] | np.ndarray | Array
KeyLike = Array | int


# ----------------------------------------------------------------------------------------------------
# The sampler's static options


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """Everything about a generation that fixes the compiled program (hashable: a jit static argument).

    The temperature and top-p values are not here: they are traced, so sweeping them reuses one
    compilation. Whether top-p is active at all is (`use_top_p`), since it adds a sort.
    """

    greedy: bool
    top_k: int | None
    use_top_p: bool
    eot_token: int | None
    window_shift: int
    return_logits: bool = False
    vocab_limit: int | None = None  # the tokenizer's vocabulary size, when the model's is padded beyond it
    output_major: bool = False  # the kernels' layout the loop reads (`decoding_weights`)

    def pick(self, logits_BV: Array, gumbel_BV: Array | None, temperature: Array, top_p: Array,
             banned: int | None) -> Array:
        return pick_tokens(logits_BV, None if self.greedy else gumbel_BV, temperature, self.top_k,
                           top_p if self.use_top_p else None, banned=banned, vocab_limit=self.vocab_limit)


def finish_rows(tok_B: Array, done_B: Array, eot_token: int | None, fill: int | None = None) -> tuple[Array, Array]:
    """Finished rows emit `fill` (by default eot again); a row that has just emitted eot is finished."""
    if eot_token is None:
        return tok_B, done_B
    tok_B = jnp.where(done_B, eot_token if fill is None else fill, tok_B)
    return tok_B, done_B | (tok_B == eot_token)


# ----------------------------------------------------------------------------------------------------
# Validation (shared by the cached and uncached paths and the CLI)


@dataclasses.dataclass(frozen=True)
class _Request:
    prompt_BT: np.ndarray
    key: Array
    max_new_tokens: int
    temperature: float
    top_p: float
    spec: SamplerSpec


def default_window_shift(cfg: ModelConfig) -> int:
    """Half the context: re-prefill every block_size/2 tokens, always condition on >= half the context."""
    return max(1, cfg.block_size // 2)


def _as_key(key: KeyLike) -> Array:
    if isinstance(key, int | np.integer):
        return jax.random.key(int(key))
    return key


def _prompt_array(prompt: PromptLike, num_samples: int | None) -> np.ndarray:
    """(T,) or (B, T) ids -> int32 (B, T); a 1-D prompt is repeated `num_samples` times (default 1)."""
    try:
        arr = np.asarray(prompt)
    except ValueError as e:  # ragged rows
        raise UserError(f"prompt rows must all have the same length ({e})") from e
    if arr.ndim == 1:
        arr = np.broadcast_to(arr, (num_samples or 1, arr.shape[0]))
    elif arr.ndim != 2:
        raise UserError(f"prompt must be a 1-D or 2-D array of token ids, got shape {arr.shape}")
    elif num_samples is not None and num_samples != arr.shape[0]:
        raise UserError(f"num_samples={num_samples} disagrees with the prompt batch of {arr.shape[0]} rows")
    if arr.shape[0] < 1:
        raise UserError("num_samples must be at least 1")
    if arr.shape[1] == 0:
        raise UserError("the prompt is empty: give at least one token (a BPE model can start from end-of-text)")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise UserError(f"prompt token ids must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int32)


# Far beyond any context jaxgpt trains, and small enough that token buffers and int32 step counters never
# overflow or exhaust memory (a (B, N) int32 buffer is allocated up front).
MAX_NEW_TOKENS = 1 << 20


def validate_options(max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any) -> None:
    """Raise UserError for values that have no meaning (the CLI calls this before loading a model)."""
    if not isinstance(max_new_tokens, int | np.integer) or not 0 < max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"max_new_tokens={max_new_tokens} must be a positive integer of at most {MAX_NEW_TOKENS:,}")
    if not (temperature >= 0 and np.isfinite(temperature)):  # also rejects NaN
        raise UserError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if top_k is not None and (not isinstance(top_k, int | np.integer) or top_k < 1):
        raise UserError(f"top_k={top_k} must be an integer >= 1 (or unset)")
    if top_p is not None and not 0 < top_p <= 1:
        raise UserError(f"top_p={top_p} must be in (0, 1] (or unset)")


def request(cfg: ModelConfig, prompt: PromptLike, *, num_samples: int | None, max_new_tokens: int,
             temperature: float, top_k: int | None, top_p: float | None, key: KeyLike, eot_token: int | None,
             window_shift: int | None, return_logits: bool, vocab_limit: int | None) -> _Request:
    validate_options(max_new_tokens, temperature, top_k, top_p)
    prompt_BT = _prompt_array(prompt, num_samples)
    V, S = cfg.vocab_size, cfg.block_size
    if bad := out_of_range(prompt_BT, V):
        raise UserError(f"prompt token ids {bad} are outside the vocabulary [0, {V})")
    if cfg.pad_id is not None and np.any(prompt_BT == cfg.pad_id):
        raise UserError(f"the prompt contains the model's padding id {cfg.pad_id}, which it never attends to")
    if eot_token is not None and not 0 <= eot_token < V:
        raise UserError(f"eot_token={eot_token} is outside the vocabulary [0, {V})")
    if vocab_limit is not None and not 0 < vocab_limit <= V:
        raise UserError(f"vocab_limit={vocab_limit} must be in [1, {V}] (the model's vocabulary)")
    if return_logits and prompt_BT.shape[0] * max_new_tokens * V * 4 > 1 << 34:
        raise UserError(f"return_logits for {prompt_BT.shape[0]} x {max_new_tokens} tokens of a {V}-token vocabulary "
                        "needs more than 16 GiB: generate fewer tokens or samples")
    shift = default_window_shift(cfg) if window_shift is None else window_shift
    if not isinstance(shift, int | np.integer) or not 1 <= shift <= S:
        raise UserError(f"window_shift={window_shift} must be an integer in [1, block_size={S}]")
    greedy = temperature == 0
    use_top_p = top_p is not None and top_p < 1 and not greedy
    spec = SamplerSpec(greedy=greedy, top_k=None if greedy or top_k is None else min(int(top_k), V),
                       use_top_p=use_top_p, eot_token=eot_token, window_shift=int(shift),
                       return_logits=return_logits, vocab_limit=None if vocab_limit in (None, V) else int(vocab_limit),
                       output_major=output_major_for(prompt_BT.shape[0]))
    return _Request(prompt_BT, _as_key(key), int(max_new_tokens), float(temperature),
                    1.0 if top_p is None else float(top_p), spec)


# ----------------------------------------------------------------------------------------------------
# The cached decode loop


class DecodeState(NamedTuple):
    """Everything the loop carries between tokens; it lives on the device for the whole generation.

    `window_BS` holds the token at each cache slot (what a re-prefill needs), `length` the number of
    valid slots, `logits_BV` the model's logits for the next token (computed by the previous step).
    """

    cache: Any
    window_BS: Array
    length: Array
    logits_BV: Array
    done_B: Array
    step: Array
    key: Array


def _decode(cfg: ModelConfig, params: Any, idx_BT: Array, cache: Any, index: Array | int,
            output_major: bool, logits_at: int | Array | None = -1) -> tuple[Array, Any]:
    """Logits of position `logits_at` of the new tokens, by default the last, which is all the decode loop samples
    from (`params`: `decoding_weights`); every position's with None (a prompt the engine scores)."""
    model = GPT(cfg, kernel_storage=kernel_storage(output_major))
    return model.apply({"params": params}, idx_BT, cache, index, logits_at, method=GPT.decode)


SHORTEST_CACHE = 128  # `cache_slots` rounds a generation's cache up to a power of two, at least this


def cache_slots(cfg: ModelConfig, prompt_length: int, max_new_tokens: int) -> int:
    """The KV cache's length for a generation: the smallest power of two >= SHORTEST_CACHE that holds it.

    Every decode step attends over the whole cache (masked), so a 500-token generation from a short
    prompt reads 512 slots per token instead of block_size (GPT-2: 1,024). The prompt's last
    min(T, block_size) tokens and all but the last new token are written; when they do not fit in
    block_size slots, the window slides (module docstring) and the cache has block_size slots.
    """
    written = min(prompt_length, cfg.block_size) + max_new_tokens - 1
    return bucket(written, cfg.block_size, SHORTEST_CACHE)


@functools.partial(jax.jit, static_argnames=("cfg", "output_major", "slots"))
def _prefill(params: Any, prompt_BT: Array, key: Array, *, cfg: ModelConfig, output_major: bool,
             slots: int | None = None) -> DecodeState:
    """Write the last min(T, block_size) prompt tokens into a fresh cache of `slots` (block_size) slots."""
    S = cfg.block_size
    window_BT = prompt_BT[:, -S:]
    B, T = window_BT.shape
    logits_BTV, cache = _decode(cfg, params, window_BT, init_cache(cfg, B, slots), 0, output_major)
    window_BS = jnp.zeros((B, S), jnp.int32).at[:, :T].set(window_BT)
    return DecodeState(cache, window_BS, jnp.int32(T), logits_BTV[:, -1], jnp.zeros((B,), bool), jnp.int32(0), key)


def _append(cfg: ModelConfig, spec: SamplerSpec, params: Any, st: DecodeState, tok_B: Array,
            commit: Array | bool = True) -> DecodeState:
    """Decode the token just sampled into the next free cache slot (the cheap, common step).

    Where `commit` is False (a step `token_loop` runs past the loop's end) the state keeps its length, logits and
    window; the cache takes a write at or past its length, which nothing reads (a full cache is re-prefilled from
    the window before its next read, so the write goes to its last slot, a position the model has)."""
    S = jax.tree.leaves(st.cache)[0].shape[-2]
    index = st.length if commit is True else jnp.minimum(st.length, S - 1)
    logits_B1V, cache = _decode(cfg, params, tok_B[:, None], st.cache, index, spec.output_major)
    written_B = tok_B if commit is True else jnp.where(commit, tok_B, st.window_BS[:, index])
    window_BS = jax.lax.dynamic_update_slice_in_dim(st.window_BS, written_B[:, None], index, axis=1)
    logits_BV = logits_B1V[:, 0] if commit is True else jnp.where(commit, logits_B1V[:, 0], st.logits_BV)
    return st._replace(cache=cache, window_BS=window_BS, length=st.length + jnp.int32(commit), logits_BV=logits_BV)


def _slide(cfg: ModelConfig, spec: SamplerSpec, params: Any, st: DecodeState, tok_B: Array) -> DecodeState:
    """The cache is full: drop the first `window_shift` tokens and re-prefill the rest at positions 0.."""
    S, shift = cfg.block_size, spec.window_shift
    keep = S + 1 - shift
    window_BK = jnp.concatenate([st.window_BS[:, shift:], tok_B[:, None]], axis=1)
    logits_BKV, cache = _decode(cfg, params, window_BK, st.cache, 0, spec.output_major)
    window_BS = jnp.pad(window_BK, ((0, 0), (0, S - keep)))
    return st._replace(cache=cache, window_BS=window_BS, length=jnp.int32(keep), logits_BV=logits_BKV[:, -1])


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "num_steps"), donate_argnames=("state",),
                   compiler_options=DECODE_OPTIONS)
def _run(params: Any, state: DecodeState, total: Array, temperature: Array, top_p: Array, *, cfg: ModelConfig,
         spec: SamplerSpec, num_steps: int) -> tuple[DecodeState, Array, Array | None, Array]:
    """Up to `num_steps` tokens (fewer once `total` are done or every row has finished).

    Two nested loops keep the per-token path free of branches: XLA copies every buffer a `lax.cond` carries, and
    a branch around the cache in the per-token loop cost more than the model's own decode step. The inner loop
    (`token_loop`) appends up to `trip_tokens` tokens while the cache has room (with noise drawn ahead for them:
    per-step random bits are a loop of their own on CPU); on accelerators it runs all its steps, those past its
    end masked, so that XLA knows its trip count. The outer loop does what happens once per trip: the token that
    fills the window and the re-prefill it triggers, or the very last token, which needs no forward pass.

    Returns the state to continue from, the tokens (B, num_steps) (unfilled slots are eot, or 0 without
    one), if `spec.return_logits` the raw model logits each token was drawn from (B, num_steps, V), and
    [tokens so far, every row finished] as int32 (2,): a buffer of its own, readable after the state has
    been donated to the next call.
    """
    B, V = state.logits_BV.shape
    fill = 0 if spec.eot_token is None else spec.eot_token
    tokens_BN = jnp.full((B, num_steps), fill, jnp.int32)
    logits_BNV = jnp.zeros((B, num_steps, V), jnp.float32) if spec.return_logits else None
    # Steps per trip: at most the call's, the context's (no segment appends more), a noise block's when sampling
    most = min(num_steps, cfg.block_size, *(() if spec.greedy else (max(1, NOISE_BLOCK_ELEMENTS // (B * V)),)))
    loop = _Loop(cfg, spec, params, total, temperature, top_p, state.step, num_steps, trip_tokens(num_steps, most))
    state, tokens_BN, logits_BNV = jax.lax.while_loop(lambda c: loop.may_sample(c[0]), loop.segment,
                                                      (state, tokens_BN, logits_BNV))
    progress = jnp.stack([state.step, jnp.all(state.done_B).astype(jnp.int32)])
    return state, tokens_BN, logits_BNV, progress


@dataclasses.dataclass(frozen=True)
class _Loop:
    """What the while loops of `_run` close over (traced values included: it lives inside one trace).

    Their carry is (state, tokens (B, num_steps), logits (B, num_steps, V) or None).
    """

    cfg: ModelConfig
    spec: SamplerSpec
    params: Any
    total: Array
    temperature: Array
    top_p: Array
    first: Array  # the step the call started at
    num_steps: int
    block: int  # steps of the inner loop per trip of the outer one (`trip_tokens`), and of noise drawn at once

    def may_sample(self, st: DecodeState) -> Array:
        return (st.step - self.first < self.num_steps) & (st.step < self.total) & ~jnp.all(st.done_B)

    def take(self, carry: tuple, gumbel_BV: Array | None, commit: Array | bool = True) -> tuple[tuple, Array]:
        """Sample the token of step `st.step` and record it (only where `commit`)."""
        st, tokens_BN, logits_BNV = carry
        i = st.step - self.first
        tok_B = self.spec.pick(st.logits_BV, gumbel_BV, self.temperature, self.top_p, self.cfg.pad_id)
        tok_B, done_B = finish_rows(tok_B, st.done_B, self.spec.eot_token)
        logits_BV = st.logits_BV
        if commit is not True:  # write back what is there (the index may be one past the end: it clamps)
            tok_B = jnp.where(commit, tok_B, jax.lax.dynamic_index_in_dim(tokens_BN, i, 1, keepdims=False))
            done_B = jnp.where(commit, done_B, st.done_B)
            if logits_BNV is not None:
                logits_BV = jnp.where(commit, logits_BV, jax.lax.dynamic_index_in_dim(logits_BNV, i, 1, False))
        tokens_BN = jax.lax.dynamic_update_slice_in_dim(tokens_BN, tok_B[:, None], i, axis=1)
        if logits_BNV is not None:
            logits_BNV = jax.lax.dynamic_update_slice_in_dim(logits_BNV, logits_BV[:, None], i, axis=1)
        st = st._replace(done_B=done_B, step=st.step + jnp.int32(commit))
        return (st, tokens_BN, logits_BNV), tok_B

    def segment(self, carry: tuple) -> tuple:
        """Tokens while the cache has room (the inner loop), then the one that fills the window or ends the
        call, and the re-prefill a full window needs."""
        cfg, spec, S = self.cfg, self.spec, self.cfg.block_size
        step0 = carry[0].step
        B, V = carry[0].logits_BV.shape
        # block + 1 rows: the token after the inner loop (at most `block` steps later) uses the last one.
        noise_nBV = None if spec.greedy else noise_block(carry[0].key, step0, self.block + 1, (B, V))

        def room(carry: tuple) -> Array:  # another token fits, and a next one will be needed
            st = carry[0]
            return self.may_sample(st) & (st.step + 1 < self.total) & (st.length < S)

        def append_one(_: Array, carry: tuple, commit: Array | bool) -> tuple:
            carry, tok_B = self.take(carry, None if spec.greedy else noise_nBV[carry[0].step - step0], commit)
            st, *rest = carry
            return (_append(cfg, spec, self.params, st, tok_B, commit), *rest)

        carry = token_loop(self.block, room, append_one, carry)
        # The token that fills the window, or the last one; nothing if the block of noise ran out.
        st = carry[0]
        commit = self.may_sample(st) & ((st.length == S) | (st.step + 1 >= self.total))
        carry, tok_B = self.take(carry, None if spec.greedy else noise_nBV[st.step - step0], commit)
        st, *rest = carry
        if jax.tree.leaves(st.cache)[0].shape[-2] == S:  # a shorter cache (`cache_slots`) never fills up
            need_slide = commit & (st.step < self.total) & ~jnp.all(st.done_B)
            st = jax.lax.cond(need_slide, lambda st: _slide(cfg, spec, self.params, st, tok_B), lambda st: st, st)
        return (st, *rest)


def _start(params: Any, cfg: ModelConfig, req: _Request, dtype: str | None) -> tuple[Any, ModelConfig, DecodeState]:
    """The weights and config the loop runs with (`decoding_weights`) and the prefilled state, for a request."""
    params, cfg = decoding_weights(params, cfg, dtype, output_major=req.spec.output_major)
    state = _prefill(params, jnp.asarray(req.prompt_BT), req.key, cfg=cfg, output_major=req.spec.output_major,
                     slots=cache_slots(cfg, req.prompt_BT.shape[1], req.max_new_tokens))
    return params, cfg, state


def generate(params: Any, cfg: ModelConfig, prompt: PromptLike, *, max_new_tokens: int, key: KeyLike = 0,
             num_samples: int | None = None, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eot_token: int | None = None, window_shift: int | None = None,
             return_logits: bool = False, vocab_limit: int | None = None,
             dtype: str | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Sample `max_new_tokens` continuations of a prompt with the KV-cache loop; returns only new tokens.

    prompt: token ids, (T,) (repeated `num_samples` times) or (B, T) (every row the same length).
    Returns int32 (B, max_new_tokens); rows that emitted `eot_token` are padded with it. With
    `return_logits`, also the float32 logits (B, max_new_tokens, V) each token was drawn from (zeros
    for steps never run because every row had finished). Compiled programs are cached per shapes and
    static options (`SamplerSpec`); new temperature/top_p values reuse them. `dtype` ("bfloat16") decodes
    with weights and activations in that dtype (`decoding_weights`); the logits are float32 either way.
    """
    req = request(cfg, prompt, num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_k=top_k, top_p=top_p, key=key, eot_token=eot_token, window_shift=window_shift,
                   return_logits=return_logits, vocab_limit=vocab_limit)
    params, cfg, state = _start(params, cfg, req, dtype)
    _, tokens_BN, logits_BNV, _ = _run(params, state, jnp.int32(req.max_new_tokens), jnp.float32(req.temperature),
                                       jnp.float32(req.top_p), cfg=cfg, spec=req.spec, num_steps=req.max_new_tokens)
    if return_logits:
        return np.asarray(tokens_BN), np.asarray(logits_BNV)
    return np.asarray(tokens_BN)


def stream(params: Any, cfg: ModelConfig, prompt: PromptLike, *, max_new_tokens: int, key: KeyLike = 0,
           num_samples: int | None = None, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, eot_token: int | None = None, window_shift: int | None = None,
           chunk_size: int = 16, vocab_limit: int | None = None, dtype: str | None = None) -> Iterator[np.ndarray]:
    """Like `generate`, but yields the new tokens (B, k) chunk by chunk as the device produces them.

    Each chunk is one call of the compiled loop (the cache stays on the device, donated between calls).
    The next chunk is dispatched before the current one is read, so the device keeps decoding while
    Python hands tokens to the caller. The tokens equal `generate`'s. Iteration ends after
    `max_new_tokens` tokens or once every row has emitted `eot_token`. `dtype` as in `generate`.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise UserError(f"chunk_size={chunk_size} must be a positive integer")
    req = request(cfg, prompt, num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_k=top_k, top_p=top_p, key=key, eot_token=eot_token, window_shift=window_shift,
                   return_logits=False, vocab_limit=vocab_limit)
    params, cfg, state = _start(params, cfg, req, dtype)
    total, temperature_, top_p_ = jnp.int32(req.max_new_tokens), jnp.float32(req.temperature), jnp.float32(req.top_p)
    run = functools.partial(_run, params, total=total, temperature=temperature_, top_p=top_p_, cfg=cfg,
                            spec=req.spec, num_steps=min(chunk_size, req.max_new_tokens))
    state, tokens_BN, _, progress = run(state)
    produced = 0
    while True:
        ahead = run(state)  # dispatched now, computed while this chunk is read (a no-op after the last one)
        (step, finished), tokens_BN = jax.device_get((progress, tokens_BN))
        yield tokens_BN[:, : step - produced]
        produced = int(step)
        if finished or produced >= req.max_new_tokens:
            return
        state, tokens_BN, _, progress = ahead
