"""Decoding for the seq2seq model (`jaxgpt.model.encdec`, an encoder-decoder): greedy, sampling and beam search.

Every function runs the encoder once per source, projects its output into each decoder layer's
cross-attention keys and values once (`Seq2SeqModel.memory_kv`), then emits one token per step in a
`lax.while_loop` through `Seq2SeqModel.decode_step`, which reads and extends a self-attention KV cache
(`attention.init_cache`). They are pure and jitted with static shapes, no host synchronization and no
Python-side early exit, so they also trace inside another `jax.jit` (the seq2seq task's evaluation calls
`greedy`); the loop stops on the device once every row has finished.

The decoder starts from `bos_id` and emits at most `max_new_tokens` tokens per source (<= block_size: the
decoder reads one position per token). A row that emits `eos_id` is finished: the eos is kept and every
later position is the padding id (`cfg.model.pad_id`, or eos for a model without one), which is never
produced. Tokens are chosen by `SamplerSpec.pick`, the GPT sampler's (greedy, temperature, top-k,
top-p); the noise of step i is `fold_in(key, i)`, so `sampling_reference.seq2seq_uncached`, which reruns
the whole model on the prefix at every step, gives the same tokens for the same key.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxgpt.errors import UserError
from jaxgpt.generate.sampling import SamplerSpec, finish_rows, validate_options
from jaxgpt.generate.strategies import gumbel_noise
from jaxgpt.model.attention import init_cache
from jaxgpt.model.config import Seq2SeqConfig
from jaxgpt.model.encdec import Seq2SeqModel

Array = jax.Array
GREEDY = SamplerSpec(greedy=True, top_k=None, use_top_p=False, eot_token=None, window_shift=1)
_STATIC = ("cfg", "bos_id", "eos_id", "max_new_tokens")


def check_length(cfg: Seq2SeqConfig, max_new_tokens: Any) -> None:
    if not isinstance(max_new_tokens, int) or not 0 < max_new_tokens <= cfg.model.block_size:
        raise UserError(f"max_new_tokens={max_new_tokens} must be in [1, block_size={cfg.model.block_size}]: "
                        "the decoder reads one position per generated token")


def sampler_spec(cfg: Seq2SeqConfig, temperature: float, top_k: int | None, top_p: float | None) -> SamplerSpec:
    """The static part of a sampling request (temperature 0 is greedy), validated as the GPT sampler's."""
    validate_options(1, temperature, top_k, top_p)
    if temperature == 0:
        return GREEDY
    V = cfg.model.vocab_size
    return SamplerSpec(greedy=False, top_k=None if top_k is None else min(int(top_k), V),
                       use_top_p=top_p is not None and top_p < 1, eot_token=None, window_shift=1)


def fill_id(cfg: Seq2SeqConfig, eos_id: int) -> int:
    """What follows a finished row: the padding id (eos when the model has none)."""
    return eos_id if cfg.model.pad_id is None else cfg.model.pad_id


def encode(params: Any, cfg: Seq2SeqConfig, src_BS: Array, copies: int = 1) -> tuple[Array, list[tuple[Array, Array]]]:
    """The source mask (B', S) and every layer's cross-attention keys/values (B', H, S, D), B' = B * copies.

    Copies of a row are adjacent (row b * copies + j), as beam search lays out its beams.
    """
    model = Seq2SeqModel(cfg)
    src_mask_BS = model.apply({"params": params}, src_BS, method=Seq2SeqModel.source_mask)
    memory_BSC = model.apply({"params": params}, src_BS, method=Seq2SeqModel.encode)
    memory_kv = model.apply({"params": params}, memory_BSC, method=Seq2SeqModel.memory_kv)
    repeat = lambda x: jnp.repeat(x, copies, axis=0)
    return repeat(src_mask_BS), jax.tree.map(repeat, memory_kv)


def _step(params: Any, cfg: Seq2SeqConfig, tok_B: Array, cache: Any, index: Array, memory_kv: Any,
          src_mask_BS: Array) -> tuple[Array, Any]:
    """Logits (B, V) after feeding one token per row at position `index`, and the updated cache."""
    logits_B1V, cache = Seq2SeqModel(cfg).apply({"params": params}, tok_B[:, None], cache, index, memory_kv,
                                                  src_mask_BS, method=Seq2SeqModel.decode_step)
    return logits_B1V[:, 0], cache


@functools.partial(jax.jit, static_argnames=(*_STATIC, "spec", "return_logits"))
def generate(params: Any, cfg: Seq2SeqConfig, src_BS: Array, key: Array | None, temperature: Array | float,
             top_p: Array | float, *, spec: SamplerSpec, bos_id: int, eos_id: int, max_new_tokens: int,
             return_logits: bool = False) -> tuple[Array, Array | None]:
    """Tokens (B, max_new_tokens) chosen by `spec`, and with `return_logits` the logits (B, N, V) of each step.

    Logits of steps never run (every row had finished) are zeros. `key` may be None for a greedy spec.
    """
    check_length(cfg, max_new_tokens)
    B, N, V = src_BS.shape[0], max_new_tokens, cfg.model.vocab_size
    src_mask_BS, memory_kv = encode(params, cfg, src_BS)
    fill = fill_id(cfg, eos_id)

    def body(carry: tuple) -> tuple:
        i, tok_B, cache, done_B, out_BN, logits_BNV = carry
        logits_BV, cache = _step(params, cfg, tok_B, cache, i, memory_kv, src_mask_BS)
        gumbel_BV = None if spec.greedy else gumbel_noise(key, i, (B, V))
        tok_B, done_B = finish_rows(spec.pick(logits_BV, gumbel_BV, temperature, top_p, cfg.model.pad_id), done_B,
                               eos_id, fill)
        if return_logits:
            logits_BNV = logits_BNV.at[:, i].set(logits_BV)
        return i + 1, tok_B, cache, done_B, out_BN.at[:, i].set(tok_B), logits_BNV

    init = (jnp.int32(0), jnp.full((B,), bos_id, jnp.int32), init_cache(cfg.model, B, N), jnp.zeros((B,), bool),
            jnp.full((B, N), fill, jnp.int32), jnp.zeros((B, N, V), jnp.float32) if return_logits else None)
    _, _, _, _, out_BN, logits_BNV = jax.lax.while_loop(lambda c: (c[0] < N) & ~jnp.all(c[3]), body, init)
    return out_BN, logits_BNV


def greedy(params: Any, cfg: Seq2SeqConfig, src_BS: Array, *, bos_id: int, eos_id: int,
           max_new_tokens: int) -> Array:
    """The most likely token at every step: int32 (B, max_new_tokens), padded after each row's eos."""
    return generate(params, cfg, src_BS, None, 1.0, 1.0, spec=GREEDY, bos_id=bos_id, eos_id=eos_id,
                    max_new_tokens=max_new_tokens)[0]


def sample(params: Any, cfg: Seq2SeqConfig, src_BS: Array, *, bos_id: int, eos_id: int, max_new_tokens: int,
           key: Array, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None) -> Array:
    """Tokens drawn from the filtered softmax(logits / temperature) (`strategies`); temperature 0 is greedy.

    temperature and top_p are traced (new values reuse the compilation); whether they are 0 or 1 is not.
    """
    spec = sampler_spec(cfg, temperature, top_k, top_p)
    return generate(params, cfg, src_BS, key, temperature, 1.0 if top_p is None else top_p, spec=spec,
                    bos_id=bos_id, eos_id=eos_id, max_new_tokens=max_new_tokens)[0]


def length_normalizer(length: Array, alpha: Array | float) -> Array:
    """GNMT's length penalty ((5 + length) / 6) ** alpha (Wu et al. 2016): alpha 0 ranks by log-probability."""
    return ((5.0 + length) / 6.0) ** alpha


@functools.partial(jax.jit, static_argnames=(*_STATIC, "beam_size"))
def beam_search(params: Any, cfg: Seq2SeqConfig, src_BS: Array, length_penalty: Array | float = 0.0, *,
                bos_id: int, eos_id: int, max_new_tokens: int, beam_size: int) -> tuple[Array, Array]:
    """The best of `beam_size` hypotheses per source: tokens (B, N) padded after eos, and their log-probability (B,).

    Hypotheses are ranked by log-probability / `length_normalizer(length, length_penalty)` (GNMT), length
    counting the generated tokens up to and including eos. Finished hypotheses stay in the beam, extended
    only by padding at no cost, and compete with the unfinished ones at every step; the search ends when
    every beam has finished or after N tokens. With one beam, the search takes the argmax of the same
    log-probabilities at every step: greedy decoding (for any length penalty). The log-probability is the
    model's full softmax (the padding id, never chosen, keeps its mass).
    """
    check_length(cfg, max_new_tokens)
    if not isinstance(beam_size, int) or beam_size < 1:
        raise UserError(f"beam_size={beam_size} must be a positive integer")
    B, K, N, V = src_BS.shape[0], beam_size, max_new_tokens, cfg.model.vocab_size
    src_mask_RS, memory_kv = encode(params, cfg, src_BS, copies=K)  # R = B * K rows, beam k of b at b * K + k
    fill = fill_id(cfg, eos_id)
    pad_id = cfg.model.pad_id
    stay_V = jnp.where(jnp.arange(V) == fill, 0.0, -jnp.inf)  # a finished hypothesis's only continuation

    def body(carry: tuple) -> tuple:
        i, tok_BK, cache, logp_BK, length_BK, done_BK, out_BKN = carry
        logits_RV, cache = _step(params, cfg, tok_BK.reshape(B * K), cache, i, memory_kv, src_mask_RS)
        lp_BKV = jax.nn.log_softmax(logits_RV).reshape(B, K, V)
        if pad_id is not None:
            lp_BKV = lp_BKV.at[..., pad_id].set(-jnp.inf)
        lp_BKV = jnp.where(done_BK[..., None], stay_V, lp_BKV)
        cand_logp_BKV = logp_BK[..., None] + lp_BKV
        cand_length_BK = jnp.where(done_BK, length_BK, i + 1)
        score_BKV = cand_logp_BKV / length_normalizer(cand_length_BK, length_penalty)[..., None]
        _, best_BK = jax.lax.top_k(score_BKV.reshape(B, K * V), K)  # sorted: beam 0 is the best
        beam_BK, tok_BK = best_BK // V, (best_BK % V).astype(jnp.int32)
        rows_R = (jnp.arange(B)[:, None] * K + beam_BK).reshape(B * K)
        cache = jax.tree.map(lambda x: x[rows_R], cache)
        logp_BK = jnp.take_along_axis(cand_logp_BKV.reshape(B, K * V), best_BK, axis=1)
        length_BK = jnp.take_along_axis(cand_length_BK, beam_BK, axis=1)
        done_BK = jnp.take_along_axis(done_BK, beam_BK, axis=1) | (tok_BK == eos_id)
        out_BKN = jnp.take_along_axis(out_BKN, beam_BK[..., None], axis=1).at[:, :, i].set(tok_BK)
        return i + 1, tok_BK, cache, logp_BK, length_BK, done_BK, out_BKN

    def running(carry: tuple) -> Array:  # beams that cannot be chosen (-inf, when K exceeds the hypotheses) never run
        i, _, _, logp_BK, _, done_BK, _ = carry
        return (i < N) & ~jnp.all(done_BK | jnp.isneginf(logp_BK))

    logp_BK = jnp.where(jnp.arange(K) == 0, 0.0, -jnp.inf)[None].repeat(B, axis=0)  # one hypothesis to start
    init = (jnp.int32(0), jnp.full((B, K), bos_id, jnp.int32), init_cache(cfg.model, B * K, N), logp_BK,
            jnp.zeros((B, K), jnp.int32), jnp.zeros((B, K), bool), jnp.full((B, K, N), fill, jnp.int32))
    _, _, _, logp_BK, _, _, out_BKN = jax.lax.while_loop(running, body, init)
    return out_BKN[:, 0], logp_BK[:, 0]
