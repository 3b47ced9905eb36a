"""AdamW with a schedule (warmup + cosine decay, or Noam's), global-norm clipping and a weight-decay mask by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from jaxgpt.errors import UserError

SCHEDULES = ("cosine", "noam")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    decay_steps: int = 5000  # includes the warmup; after it the rate stays at min_lr
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global norm; 0 disables clipping
    # "cosine": warmup to lr, cosine to min_lr at decay_steps. "noam": "Attention is all you need", lr is its
    # factor: lr * d_model^-0.5 * min(n^-0.5, n * warmup_steps^-1.5) at update n (min_lr, decay_steps unused).
    schedule: str = "cosine"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise UserError(f"optim.schedule={self.schedule!r} is unknown: choose one of {SCHEDULES}")
        if self.schedule == "noam" and self.warmup_steps < 1:
            raise UserError("optim.warmup_steps must be >= 1 for optim.schedule='noam' (its peak is at warmup_steps)")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise UserError(f"optim.lr={self.lr}, optim.min_lr={self.min_lr}: need 0 <= min_lr <= lr and lr > 0")
        if self.warmup_steps < 0 or self.decay_steps <= self.warmup_steps:
            raise UserError(f"optim.warmup_steps={self.warmup_steps}, optim.decay_steps={self.decay_steps}: "
                            "need 0 <= warmup_steps < decay_steps (decay_steps includes the warmup)")
        if not 0 <= self.b1 < 1 or not 0 <= self.b2 < 1:
            raise UserError(f"optim.b1={self.b1}, optim.b2={self.b2} must be in [0, 1)")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise UserError("optim.weight_decay and optim.grad_clip must be >= 0")


def decay_mask(params: Any) -> Any:
    """Decay only matmul kernels: never biases, norms or embeddings.

    Chosen by name, not rank: under `nn.scan` a norm scale is (L, C) and would look like a matrix.
    """
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({path: path[-1] == "kernel" for path in flat})


def noam(factor: float, d_model: int, warmup_steps: int) -> optax.Schedule:
    """The Transformer paper's rate: linear warmup to factor / sqrt(d_model * warmup_steps) at update
    `warmup_steps`, then decay as 1 / sqrt(update). Updates count from 1, so step 0 is a real update."""

    def rate(count: jax.Array) -> jax.Array:
        n = jnp.asarray(count, jnp.float32) + 1.0
        return factor * d_model**-0.5 * jnp.minimum(n**-0.5, n * warmup_steps**-1.5)

    return rate


def schedule(cfg: OptimConfig, d_model: int | None = None) -> optax.Schedule:
    """`cfg.schedule`: linear warmup from lr/warmup to lr, then cosine to min_lr at decay_steps (the warmup
    starts above zero so that step 0 is a real update); or Noam's, which scales by the model's width."""
    if cfg.schedule == "noam":
        if not d_model:
            raise ValueError("the noam schedule scales by the model's width: pass d_model")
        return noam(cfg.lr, d_model, cfg.warmup_steps)
    init = cfg.lr / max(cfg.warmup_steps, 1)
    return optax.warmup_cosine_decay_schedule(init_value=init if cfg.warmup_steps else cfg.lr, peak_value=cfg.lr,
                                              warmup_steps=cfg.warmup_steps, decay_steps=cfg.decay_steps,
                                              end_value=cfg.min_lr)


def make_optimizer(cfg: OptimConfig, d_model: int | None = None) -> optax.GradientTransformation:
    """`d_model` (the model's width) is needed by the noam schedule only."""
    # The mask is a function: it must be static, or inject_hyperparams would call it as a schedule.
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=schedule(cfg, d_model), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
        mask=decay_mask)
    if cfg.grad_clip:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw


def current_lr(opt_state: Any) -> jax.Array:
    """The learning rate used by the last update (inject_hyperparams keeps it in the state)."""
    return optax.tree.get(opt_state, "learning_rate", filtering=lambda _, v: isinstance(v, jax.Array))
