"""The sampler's no-cache reference: the same generation as `jaxgpt.generate.sampling.generate`, computed naively.

The whole model runs on the current window at every step, as nanoGPT generates (but compiled): the
reference the cached loop is tested against, and the baseline of benchmarks/bench_sample.py. It follows
the same windowed rule, sampling strategies and noise (`fold_in(key, step)`), so equal seeds give equal tokens.
`seq2seq_uncached` is the same for the encoder-decoder's decoding (`jaxgpt.generate.seq2seq`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.generate import seq2seq as seq2seq_decoding
from jaxgpt.generate.sampling import KeyLike, PromptLike, SamplerSpec, finish_rows, request
from jaxgpt.generate.strategies import gumbel_noise
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig
from jaxgpt.model.encdec import Seq2SeqModel
from jaxgpt.model.gpt import GPT

Array = jax.Array


def _bucket(n: int, cap: int) -> int:
    """Next power of two >= n (at most `cap`): few compilations, and cost still grows with the context."""
    return min(cap, 1 << max(0, n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg",))
def _window_logits(params: Any, window_BL: Array, length: Array, *, cfg: ModelConfig) -> Array:
    """Full forward pass over a right-padded window; the logits at its last real token.

    Padding on the right cannot change earlier positions (attention is causal), so this is the model
    run on exactly the window, with one compilation per padded length instead of one per length.
    """
    logits_BLV = GPT(cfg).apply({"params": params}, window_BL)
    return jax.lax.dynamic_index_in_dim(logits_BLV, length - 1, axis=1, keepdims=False)


@functools.partial(jax.jit, static_argnames=("spec", "banned"))
def _sample_step(logits_BV: Array, key: Array, step: Array, done_B: Array, temperature: Array, top_p: Array, *,
                 spec: SamplerSpec, banned: int | None) -> tuple[Array, Array]:
    gumbel_BV = None if spec.greedy else gumbel_noise(key, step, logits_BV.shape)
    tok_B = spec.pick(logits_BV, gumbel_BV, temperature, top_p, banned)
    return finish_rows(tok_B, done_B, spec.eot_token)


def generate_uncached(params: Any, cfg: ModelConfig, prompt: PromptLike, *, max_new_tokens: int, key: KeyLike = 0,
                      num_samples: int | None = None, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None, eot_token: int | None = None, window_shift: int | None = None,
                      return_logits: bool = False, bucketed: bool = True,
                      vocab_limit: int | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The same generation as `generate`, computed the naive way: the whole model on the window, every step.

    A Python loop, one jitted forward pass per token (as nanoGPT generates, but compiled): the
    reference the cached loop is tested against, and the baseline of the benchmark. Same arguments
    and result as `generate`. The window is right-padded to a power of two (`bucketed`, so the cost
    grows with the context as nanoGPT's does) or always to block_size (one compilation).
    """
    req = request(cfg, prompt, num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_k=top_k, top_p=top_p, key=key, eot_token=eot_token, window_shift=window_shift,
                   return_logits=return_logits, vocab_limit=vocab_limit)
    S, spec = cfg.block_size, req.spec
    seq_BN = req.prompt_BT
    B, P = seq_BN.shape
    start = max(0, P - S)
    fill = 0 if spec.eot_token is None else spec.eot_token
    tokens_BN = np.full((B, req.max_new_tokens), fill, np.int32)
    logits_BNV = np.zeros((B, req.max_new_tokens, cfg.vocab_size), np.float32)
    done_B = jnp.zeros((B,), bool)
    temperature, top_p = jnp.float32(req.temperature), jnp.float32(req.top_p)
    for step in range(req.max_new_tokens):
        window_BL = seq_BN[:, start:]
        L = window_BL.shape[1]
        padded_BL = np.pad(window_BL, ((0, 0), (0, (_bucket(L, S) if bucketed else S) - L)))
        logits_BV = _window_logits(params, jnp.asarray(padded_BL), jnp.int32(L), cfg=cfg)
        tok_B, done_B = _sample_step(logits_BV, req.key, jnp.int32(step), done_B, temperature, top_p, spec=spec,
                                     banned=cfg.pad_id)
        tokens_BN[:, step] = np.asarray(tok_B)
        logits_BNV[:, step] = np.asarray(logits_BV)
        if bool(jnp.all(done_B)):
            break
        seq_BN = np.concatenate([seq_BN, tokens_BN[:, step : step + 1]], axis=1)
        if seq_BN.shape[1] - start > S:  # the window would exceed the context: jump forward
            start += spec.window_shift
    if return_logits:
        return tokens_BN, logits_BNV
    return tokens_BN


@functools.partial(jax.jit, static_argnames=("cfg",))
def _seq2seq_logits(params: Any, src_BS: Array, tgt_BN: Array, index: Array, *, cfg: Seq2SeqConfig) -> Array:
    """The whole encoder-decoder on the source and a right-padded target; the logits at position `index`.

    The decoder is causal, so what follows `index` cannot change them.
    """
    logits_BNV = Seq2SeqModel(cfg).apply({"params": params}, src_BS, tgt_BN)
    return jax.lax.dynamic_index_in_dim(logits_BNV, index, axis=1, keepdims=False)


def seq2seq_uncached(params: Any, cfg: Seq2SeqConfig, src_BS: Array | np.ndarray, *, bos_id: int, eos_id: int,
                     max_new_tokens: int, key: Array | None = None, temperature: float = 0.0,
                     top_k: int | None = None, top_p: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`seq2seq_decoding.generate` computed naively: encoder and decoder rerun on the whole prefix, every step.

    Returns the tokens (B, N) and the logits (B, N, V) each was chosen from (zeros once every row has finished).
    """
    seq2seq_decoding.check_length(cfg, max_new_tokens)
    spec = seq2seq_decoding.sampler_spec(cfg, temperature, top_k, top_p)
    src_BS = jnp.asarray(src_BS)
    B, N, V = src_BS.shape[0], max_new_tokens, cfg.model.vocab_size
    fill = seq2seq_decoding.fill_id(cfg, eos_id)
    tgt_BN = np.full((B, N), fill, np.int32)
    tgt_BN[:, 0] = bos_id
    tokens_BN = np.full((B, N), fill, np.int32)
    logits_BNV = np.zeros((B, N, V), np.float32)
    done_B = jnp.zeros((B,), bool)
    temperature_, top_p_ = jnp.float32(temperature), jnp.float32(1.0 if top_p is None else top_p)
    for step in range(N):
        logits_BV = _seq2seq_logits(params, src_BS, jnp.asarray(tgt_BN), jnp.int32(step), cfg=cfg)
        tok_B, _ = _sample_step(logits_BV, key, jnp.int32(step), done_B, temperature_, top_p_, spec=spec,
                                banned=cfg.model.pad_id)
        tok_B, done_B = finish_rows(tok_B, done_B, eos_id, fill)
        tokens_BN[:, step] = np.asarray(tok_B)
        logits_BNV[:, step] = np.asarray(logits_BV)
        if bool(jnp.all(done_B)):
            break
        if step + 1 < N:
            tgt_BN[:, step + 1] = tokens_BN[:, step]
    return tokens_BN, logits_BNV
