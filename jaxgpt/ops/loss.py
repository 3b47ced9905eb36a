"""A cross-entropy that never holds the whole (B, T, V) float32 logits tensor.

The loss is computed `chunk` positions at a time in a `lax.scan` whose body is rematerialized: the float32
logits of one chunk exist at a time, forward and backward, instead of the whole tensor (which for GPT-2
grows with tokens per chip times a 50k vocabulary). Shapes: B batch, T sequence, C n_embd, V vocabulary.
The z-loss (`z_loss`) is added chunk by chunk too: it needs each position's log-partition, from the same logits.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

Array = jax.Array


def z_loss(logits_BTV: Array) -> Array:
    """Per-position squared log-partition log(sum exp logits)^2, (B, T): PaLM's auxiliary loss. Weighted
    into the training loss it pulls log Z toward 0, so the logits cannot drift upward together (softmax
    ignores a shared shift, the gradient of the cross-entropy alone never corrects it) and stay in range."""
    return jnp.square(jax.nn.logsumexp(logits_BTV, axis=-1))


def chunked_cross_entropy(logits_fn: Callable[[Array], Array], h_BTC: Array, targets_BT: Array,
                          chunk: int, z_loss_weight: float = 0.0) -> Array:
    """Mean next-token cross-entropy of hidden states, `chunk` positions at a time (chunk divides T), plus
    `z_loss_weight` times the mean `z_loss` when it is non-zero.

    `logits_fn` is the model's head (hidden (B, t, C) -> float32 logits (B, t, V)), so tied and untied
    heads and their dtypes are exactly the dense path's. Chunks run along the sequence, keeping each
    chunk's rows split over the batch axes like the rest of the step; the scan body is rematerialized,
    so its backward pass recomputes one chunk's logits instead of storing all of them.
    """
    B, T, C = h_BTC.shape
    n = T // chunk
    h_NBtC = h_BTC.reshape(B, n, chunk, C).swapaxes(0, 1)
    y_NBt = targets_BT.reshape(B, n, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def chunk_sum(h_BtC: Array, y_Bt: Array) -> Array:
        logits_BtV = logits_fn(h_BtC)
        loss_Bt = optax.softmax_cross_entropy_with_integer_labels(logits_BtV, y_Bt)
        if z_loss_weight:
            loss_Bt = loss_Bt + z_loss_weight * z_loss(logits_BtV)
        return loss_Bt.sum()

    def body(total: Array, xs: tuple[Array, Array]) -> tuple[Array, None]:
        return total + chunk_sum(*xs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (h_NBtC, y_NBt))
    return total / (B * T)
