"""The pure functions that training compiles: loss, one optimizer step, evaluation.

State is a plain dict {"params", "opt_state", "step"}: explicit, a pytree, and exactly
what a checkpoint holds. Dropout randomness for step i is `fold_in(key, i)`, so a resumed
run draws the same masks as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxgpt.optim import current_lr

State = dict[str, Any]


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT).mean()


def make_train_step(model: nn.Module, tx: optax.GradientTransformation) -> Callable[..., tuple[State, dict]]:
    """Build `train_step(state, batch, key) -> (state, metrics)`.

    `batch` is {"x", "y"} of shape (A, b, T): A micro-batches whose gradients are averaged
    in a `lax.scan` (gradient accumulation without a Python loop or extra optimizer state).
    """

    def loss_fn(params: Any, x_BT: jax.Array, y_BT: jax.Array, key: jax.Array) -> jax.Array:
        deterministic = not _has_dropout(model)
        logits = model.apply({"params": params}, x_BT, deterministic=deterministic,
                             rngs=None if deterministic else {"dropout": key})
        return cross_entropy(logits, y_BT)

    grad_fn = jax.value_and_grad(loss_fn)

    def train_step(state: State, batch: dict[str, jax.Array], key: jax.Array) -> tuple[State, dict]:
        step_key = jax.random.fold_in(key, state["step"])
        n_micro = batch["x"].shape[0]

        def micro(carry: tuple, inputs: tuple) -> tuple:
            loss_sum, grad_sum = carry
            x_BT, y_BT, i = inputs
            loss, grads = grad_fn(state["params"], x_BT, y_BT, jax.random.fold_in(step_key, i))
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

        zeros = jax.tree.map(jnp.zeros_like, state["params"])
        (loss_sum, grad_sum), _ = jax.lax.scan(micro, (jnp.zeros((), jnp.float32), zeros),
                                               (batch["x"], batch["y"], jnp.arange(n_micro)))
        loss, grads = loss_sum / n_micro, jax.tree.map(lambda g: g / n_micro, grad_sum)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": current_lr(opt_state)}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return train_step


def make_eval_step(model: nn.Module) -> Callable[[Any, dict[str, jax.Array]], jax.Array]:
    """Mean loss of one (b, T) batch with dropout off."""

    def eval_step(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return cross_entropy(model.apply({"params": params}, batch["x"]), batch["y"])

    return eval_step


def _has_dropout(model: nn.Module) -> bool:
    cfg = model.cfg
    return any(r > 0 for r in (cfg.embd_dropout, cfg.attn_dropout, cfg.resid_dropout, cfg.ff_dropout))
