"""A cross-entropy that never holds the whole (B, T, V) float32 logits tensor.

The loss is computed `chunk` positions at a time, each chunk's body rematerialized: the float32 logits of one
chunk exist at a time, forward and backward, instead of the whole tensor (which for GPT-2 grows with tokens per
chip times a 50k vocabulary). Shapes: B batch, T sequence, C n_embd, V vocabulary.
The z-loss (`z_loss`) is added chunk by chunk too: it needs each position's log-partition, from the same logits.
Each position's loss is `token_nll`, whose gradient is one element-wise pass over a chunk's logits, and the
chunk's reductions over the vocabulary are kept for the backward pass (`keep_reductions`), so that pass is the
only one the backward makes over the recomputed logits.

Two layouts of the same sum. A `lax.scan` (TPUs, CPUs): one loop, compiled once, whatever the number of chunks.
Unrolled (GPUs): XLA:GPU launches every kernel of a `while` body from the host on every trip, outside the
step's CUDA graphs, so the scan's two loops (forward, and backward) put host launches on the step's critical
path; unrolled, the chunks are plain kernels of the step. Each chunk's input and the head's weights pass
through an `optimization_barrier` together with the running total, so chunk i+1 cannot start before chunk i's sum
exists, and in the backward pass chunk i's gradients wait for chunk i+1's (the barrier's transpose joins them):
the compiler can neither hold several chunks' logits at once nor every chunk's head-weight gradient before
summing them, and the memory bound stays the scan's (tests/compile/test_gpu_program.py reads it from programs compiled
for an H100).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxgpt.ops.platform import on_gpu

Array = jax.Array


def z_loss(logits_BTV: Array) -> Array:
    """Per-position squared log-partition log(sum exp logits)^2, (B, T): PaLM's auxiliary loss. Weighted
    into the training loss it pulls log Z toward 0, so the logits cannot drift upward together (softmax
    ignores a shared shift, the gradient of the cross-entropy alone never corrects it) and stay in range."""
    return jnp.square(jax.nn.logsumexp(logits_BTV, axis=-1))


@jax.custom_jvp
def target_logit(logits_BTV: Array, targets_BT: Array) -> Array:
    """logits[b, t, targets[b, t]], (B, T) (or any other leading axes), for targets in [0, V): gathered (B x T
    reads, not a pass over the logits), and differentiated as a comparison of the vocabulary's indices with the
    targets.

    The gather's own gradient would be a scatter into a zeroed (B, T, V) float32 buffer, then a product and a
    conversion: three passes over logits-sized data per loss chunk. The comparison's transpose is a select that
    fuses into the softmax's gradient, the one pass over the logits the backward makes anyway (what that saves
    for GPT-2 on a GPU: docs/scaling.md, section 5)."""
    return jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]


@target_logit.defjvp
def _target_logit_jvp(primals: tuple[Array, Array], tangents: tuple[Array, Any]) -> tuple[Array, Array]:
    logits_BTV, targets_BT = primals
    is_target_BTV = jax.lax.broadcasted_iota(jnp.int32, logits_BTV.shape, logits_BTV.ndim - 1) == targets_BT[..., None]
    return target_logit(logits_BTV, targets_BT), jnp.sum(jnp.where(is_target_BTV, tangents[0], 0), axis=-1)


def token_nll(logits_BTV: Array, targets_BT: Array) -> Array:
    """Per-position cross-entropy log(sum exp logits) - logits[target], (B, T), for targets in [0, V): optax's
    `softmax_cross_entropy_with_integer_labels`, with a gradient of one element-wise pass (`target_logit`)."""
    return jax.nn.logsumexp(logits_BTV, axis=-1) - target_logit(logits_BTV, targets_BT)


def token_cross_entropy(logits_BTV: Array, targets_BT: Array, label_smoothing: float = 0.0) -> Array:
    """Per-token cross-entropy (B, T) against the targets smoothed toward uniform: optax.smooth_labels'
    (1 - a) one_hot + a / V, computed without materializing that (B, T, V) distribution."""
    nll_BT = token_nll(logits_BTV, targets_BT)
    if not label_smoothing:
        return nll_BT
    uniform_BT = jax.nn.logsumexp(logits_BTV, axis=-1) - logits_BTV.mean(axis=-1)  # mean over v of -log p_v
    return (1.0 - label_smoothing) * nll_BT + label_smoothing * uniform_BT


def masked_mean(values: Array, mask: Array) -> Array:
    """The mean of `values` where `mask` weighs them (0 leaves one out), 0 when nothing is weighed: a batch made
    only of filler rows or masked positions contributes no loss rather than a division by zero."""
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def cross_entropy(logits_BTV: Array, targets_BT: Array, label_smoothing: float = 0.0) -> Array:
    return token_cross_entropy(logits_BTV, targets_BT, label_smoothing).mean()


def keep_reductions(primitive: jax.extend.core.Primitive, *_: Any, **__: Any) -> bool:
    """A loss chunk's checkpoint policy: keep its reductions over the vocabulary (the logits' max and sum of
    exponentials, one number a position) for the backward pass, which then recomputes the head's product and
    passes over its logits once, for the gradient, instead of three times (the two reductions again first)."""
    return primitive in (jax.lax.reduce_max_p, jax.lax.reduce_sum_p)


def chunked_cross_entropy(logits_fn: Callable[[Array], Array], h_BTC: Array, targets_BT: Array,
                          chunk: int, z_loss_weight: float = 0.0, unroll: bool | None = None) -> Array:
    """Mean next-token cross-entropy of hidden states, `chunk` positions at a time (chunk divides T), plus
    `z_loss_weight` times the mean `z_loss` when it is non-zero.

    `logits_fn` is the model's head (hidden (B, t, C) -> float32 logits (B, t, V)), so tied and untied
    heads and their dtypes are exactly the dense path's. Chunks run along the sequence, keeping each
    chunk's rows split over the batch axes like the rest of the step; each chunk is rematerialized,
    so the backward pass recomputes one chunk's logits instead of storing all of them. `unroll` picks the
    layout (see the module docstring); None: unrolled on GPUs, a scan elsewhere.
    """
    B, T, C = h_BTC.shape
    n = T // chunk
    h_NBtC = h_BTC.reshape(B, n, chunk, C).swapaxes(0, 1)
    y_NBt = targets_BT.reshape(B, n, chunk).swapaxes(0, 1)

    # The head's closed-over weights as explicit inputs, so the unrolled chunks can pass them along in order.
    head, weights = jax.closure_convert(logits_fn, h_NBtC[0])

    @functools.partial(jax.checkpoint, policy=keep_reductions)
    def chunk_sum(h_BtC: Array, y_Bt: Array, weights: list[Array]) -> Array:
        logits_BtV = head(h_BtC, *weights)
        loss_Bt = token_nll(logits_BtV, y_Bt)
        if z_loss_weight:
            loss_Bt = loss_Bt + z_loss_weight * z_loss(logits_BtV)
        return loss_Bt.sum()

    total = jnp.zeros((), jnp.float32)
    if unroll if unroll is not None else on_gpu():
        for h_BtC, y_Bt in zip(h_NBtC, y_NBt, strict=True):
            # chunk i+1 waits for chunk i's sum, and in the backward pass chunk i for chunk i+1's gradients
            h_BtC, weights, total = jax.lax.optimization_barrier((h_BtC, weights, total))
            total = total + chunk_sum(h_BtC, y_Bt, weights)
    else:
        total, _ = jax.lax.scan(lambda acc, xs: (acc + chunk_sum(*xs, weights), None), total, (h_NBtC, y_NBt))
    return total / (B * T)
