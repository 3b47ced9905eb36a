"""Sampling strategies: how one token per row is chosen from a step's logits.

Temperature 0 is greedy (argmax). Otherwise the logits are divided by the temperature, then top-k keeps
the k largest, then top-p (nucleus) keeps the smallest set of the remaining tokens whose probability mass
reaches p, and a token is drawn from what is left (Gumbel-max: the argmax of the filtered logits plus
Gumbel noise). Ties at a cut-off are all kept. The noise of step i comes from `jax.random.fold_in(key, i)`,
so a seed gives the same tokens however the decode loop (`jaxgpt.generate.sampling`) is split into calls.

These are pure functions of arrays, traceable inside the compiled loop and usable on their own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def filter_logits(logits_BV: Array, top_k: int | None = None, top_p: Array | float | None = None) -> Array:
    """Set to -inf every logit outside the top-k set, then outside the top-p (nucleus) set.

    `top_p` is applied to the distribution that top-k leaves (renormalized), and the most likely token
    always survives. Both cut-offs are thresholds on the logit value, so tokens tied with the last kept
    one are kept too. When top-k is active only its k sorted values are needed for top-p, which avoids
    sorting the whole vocabulary every step.
    """
    V = logits_BV.shape[-1]
    use_k = top_k is not None and top_k < V
    if not use_k and top_p is None:
        return logits_BV
    sorted_BK = jax.lax.top_k(logits_BV, top_k)[0] if use_k else -jnp.sort(-logits_BV, axis=-1)  # descending
    if top_p is None:
        threshold_B = sorted_BK[:, -1]
    else:
        probs_BK = jax.nn.softmax(sorted_BK, axis=-1)
        mass_before_BK = jnp.cumsum(probs_BK, axis=-1) - probs_BK
        keep_BK = mass_before_BK < top_p
        threshold_B = jnp.min(jnp.where(keep_BK, sorted_BK, jnp.inf), axis=-1)
    return jnp.where(logits_BV >= threshold_B[:, None], logits_BV, -jnp.inf)


def gumbel_noise(key: Array, step: Array, shape: tuple[int, int]) -> Array:
    """The Gumbel noise of one decode step: it turns sampling into an argmax (the Gumbel-max trick).

    Step i uses `fold_in(key, i)`, so the noise depends only on the seed and the step number, and can
    be drawn ahead for a block of steps without changing any sample.
    """
    return jax.random.gumbel(jax.random.fold_in(key, step), shape, jnp.float32)


# Noise drawn ahead for a block of steps is capped at this many floats (4 MiB) so large vocabularies and
# batches do not allocate much; small vocabularies get a block as long as the context.
NOISE_BLOCK_ELEMENTS = 1 << 20


def noise_block(key: Array, step0: Array, n: int, shape: tuple[int, int]) -> Array:
    """Gumbel noise of steps step0 .. step0+n-1, drawn at once: (n, B, V). Per-step random bits are a loop of
    their own on CPUs, so the decode loop draws a block ahead (`jaxgpt.generate.sampling`)."""
    return jax.vmap(lambda i: gumbel_noise(key, step0 + i, shape))(jnp.arange(n))


def first_argmax(x_BV: Array) -> Array:
    """`jnp.argmax(x_BV, -1)` as int32 (ties and NaN alike: the first), as a max and a min over the row.

    XLA:CPU runs argmax's (value, index) reduction one element at a time, where these two plain reductions
    are vectorized (benchmarks/bench_sample.py's docstring has the measurement).
    """
    hit_BV = (x_BV == x_BV.max(axis=-1, keepdims=True)) | jnp.isnan(x_BV)
    V = x_BV.shape[-1]
    return jnp.min(jnp.where(hit_BV, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def pick_tokens(logits_BV: Array, gumbel_BV: Array | None, temperature: Array | float = 1.0,
                top_k: int | None = None, top_p: Array | float | None = None, *, banned: int | None = None,
                vocab_limit: int | None = None) -> Array:
    """One token per row (int32 (B,)): argmax when `gumbel_BV` is None (greedy), else a sample.

    A sample is argmax(filtered logits / temperature + Gumbel noise), which draws from
    softmax(filtered logits / temperature). The temperature stays a traced value, so changing it
    does not recompile. `banned` is an id never produced (the model's padding id); ids from `vocab_limit`
    up are never produced either (a vocabulary padded past its tokenizer's, as GPT-2's 50257 to 50304).
    """
    logits_BV = logits_BV.astype(jnp.float32)
    if banned is not None:
        logits_BV = logits_BV.at[:, banned].set(-jnp.inf)
    if vocab_limit is not None and vocab_limit < logits_BV.shape[-1]:
        logits_BV = jnp.where(jnp.arange(logits_BV.shape[-1]) < vocab_limit, logits_BV, -jnp.inf)
    if gumbel_BV is None:
        return first_argmax(logits_BV)
    scaled_BV = filter_logits(logits_BV / temperature, top_k, top_p)
    return first_argmax(scaled_BV + gumbel_BV)
