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
# loss(params, batch, key, *frozen) -> (scalar loss, {name: scalar}): the key is for dropout; frozen are inputs
# that are never trained (a LoRA run's base, `jaxgpt.train.lora`), none for most tasks.
Loss = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


def make_train_step(loss: Loss, tx: optax.GradientTransformation) -> Callable[..., tuple[State, dict]]:
    """Build `train_step(state, batch, key, *frozen) -> (state, metrics)`: `frozen` go to the loss undifferentiated.

    Every leaf of `batch` has a leading micro-batch axis A: their gradients are averaged in a `lax.scan`
    (gradient accumulation without a Python loop or extra optimizer state). One micro-batch takes no loop:
    on a GPU a loop is a host round trip per trip (XLA reads its condition back), and the scan of one would
    also keep the whole forward and backward pass in a loop body. Metrics are the loss, the task's own terms
    (averaged the same way), the gradient norm and the learning rate used.
    """
    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def train_step(state: State, batch: Batch, key: jax.Array, *frozen: Any) -> tuple[State, dict]:
        step_key = jax.random.fold_in(key, state["step"])
        n_micro = jax.tree.leaves(batch)[0].shape[0]

        def one(micro_batch: Batch, i: Any) -> tuple[dict, Any]:
            """({"loss", the task's terms}, gradients) of micro-batch i."""
            (value, terms), grads = grad_fn(state["params"], micro_batch, jax.random.fold_in(step_key, i), *frozen)
            return {"loss": value, **terms}, grads

        first = jax.tree.map(lambda x: x[0], batch)
        if n_micro == 1:
            sums, grads = one(first, 0)
        else:
            def micro(carry: tuple, inputs: tuple) -> tuple:
                return jax.tree.map(jnp.add, carry, one(*inputs)), None

            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(one, first, 0))
            (sums, grad_sum), _ = jax.lax.scan(micro, zeros, (batch, jnp.arange(n_micro)))
            grads = jax.tree.map(lambda g: g / n_micro, grad_sum)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {**jax.tree.map(lambda v: v / n_micro, sums), "grad_norm": optax.tree.norm(grads),
                   "lr": current_lr(opt_state)}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return train_step
