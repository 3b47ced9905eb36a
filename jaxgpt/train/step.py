"""The pure function that training compiles: one optimizer step of any task's loss.

State is a plain dict {"params", "opt_state", "step"}: explicit, a pytree, and exactly what a checkpoint
holds. Randomness for step i is `fold_in(key, i)`, so a resumed run draws the same dropout masks as an
uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxgpt.train.optim import current_lr

State = dict[str, Any]
Batch = dict[str, jax.Array]
# loss(params, batch, key) -> (scalar loss, {name: scalar}): the key is for dropout.
Loss = Callable[[Any, Batch, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


def make_train_step(loss: Loss, tx: optax.GradientTransformation) -> Callable[..., tuple[State, dict]]:
    """Build `train_step(state, batch, key) -> (state, metrics)`.

    Every leaf of `batch` has a leading micro-batch axis A: their gradients are averaged in a `lax.scan`
    (gradient accumulation without a Python loop or extra optimizer state). Metrics are the loss, the
    task's own terms (averaged the same way), the gradient norm and the learning rate used.
    """
    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def train_step(state: State, batch: Batch, key: jax.Array) -> tuple[State, dict]:
        step_key = jax.random.fold_in(key, state["step"])
        n_micro = jax.tree.leaves(batch)[0].shape[0]

        def micro(carry: tuple, inputs: tuple) -> tuple:
            sums, grad_sum = carry
            micro_batch, i = inputs
            (value, terms), grads = grad_fn(state["params"], micro_batch, jax.random.fold_in(step_key, i))
            sums = jax.tree.map(jnp.add, sums, {"loss": value, **terms})
            return (sums, jax.tree.map(jnp.add, grad_sum, grads)), None

        shapes = jax.eval_shape(loss, state["params"], jax.tree.map(lambda x: x[0], batch), step_key)[1]
        zero_sums = {"loss": jnp.zeros((), jnp.float32), **jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)}
        zeros = jax.tree.map(jnp.zeros_like, state["params"])
        (sums, grad_sum), _ = jax.lax.scan(micro, (zero_sums, zeros), (batch, jnp.arange(n_micro)))
        grads = jax.tree.map(lambda g: g / n_micro, grad_sum)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {**jax.tree.map(lambda v: v / n_micro, sums), "grad_norm": optax.tree.norm(grads),
                   "lr": current_lr(opt_state)}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return train_step
