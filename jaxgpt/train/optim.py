"""The optimizer: AdamW, or Muon for the hidden matrices beside AdamW for the rest; a schedule (warmup + cosine,
warmup-stable-decay, or Noam's); global-norm clipping; a weight-decay mask by name.

Muon's partition is explicit and by role, read from the logical axis names every parameter declares for
sharding, never from its rank: under `nn.scan` a (L, C, 3C) kernel is L matrices and a (L, C) norm scale is
no matrix at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util
from optax.contrib import MuonDimensionNumbers

from jaxgpt.errors import UserError

SCHEDULES = ("cosine", "wsd", "noam")
OPTIMIZERS = ("adamw", "muon")
COOLDOWN_SHAPES = ("linear", "1-sqrt")
MUON, ADAMW = "muon", "adamw"  # the partition's labels
# Axis names of the network's inputs and outputs (token and position tables, LM and class heads): AdamW's.
NOT_HIDDEN = ("vocab", "position", "classes")
# Axis names that index separate matrices rather than a matrix's rows or columns: the scanned layer axis, and
# the unnamed Q/K/V (or K/V) axis of a fused projection (each of Q, K and V is orthogonalised on its own).
STACKED = ("layers", None)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3  # AdamW's peak rate (with optimizer "muon": for embeddings, head, norms and biases)
    min_lr: float = 1e-4
    warmup_steps: int = 100
    decay_steps: int = 5000  # includes the warmup; after it the rate stays at min_lr
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global norm; 0 disables clipping
    # "cosine": warmup to lr, cosine to min_lr at decay_steps. "wsd": warmup, lr held, then a cooldown to min_lr
    # over the last cooldown_fraction of decay_steps. "noam": "Attention is all you need", lr is its factor:
    # lr * d_model^-0.5 * min(n^-0.5, n * warmup_steps^-1.5) at update n (min_lr, decay_steps unused).
    schedule: str = "cosine"
    cooldown_fraction: float = 0.2  # schedule "wsd": the share of decay_steps spent cooling down
    cooldown_shape: str = "linear"  # schedule "wsd": "linear" or "1-sqrt" (1 - sqrt(t / cooldown) of the way)
    # "adamw" for every parameter; "muon": Muon for the hidden matrices, AdamW for the rest (`param_groups`)
    optimizer: str = "adamw"
    muon_lr: float = 0.02  # Muon's peak rate; it follows the same schedule as lr, scaled by muon_lr / lr
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    muon_weight_decay: float = 0.0  # decoupled decay of the hidden matrices under Muon (times its rate)

    def __post_init__(self) -> None:
        for key, value, known in (("schedule", self.schedule, SCHEDULES), ("optimizer", self.optimizer, OPTIMIZERS),
                                  ("cooldown_shape", self.cooldown_shape, COOLDOWN_SHAPES)):
            if value not in known:
                raise UserError(f"optim.{key}={value!r} is unknown: choose one of {known}")
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
        self._check_wsd_and_muon()

    def _check_wsd_and_muon(self) -> None:
        if not 0 <= self.cooldown_fraction <= 1:
            raise UserError(f"optim.cooldown_fraction={self.cooldown_fraction} must be in [0, 1]")
        if self.schedule == "wsd" and self.warmup_steps + cooldown_steps(self) > self.decay_steps:
            raise UserError(f"optim.warmup_steps={self.warmup_steps} and optim.cooldown_fraction="
                            f"{self.cooldown_fraction} of optim.decay_steps={self.decay_steps} overlap: the warmup "
                            "and the cooldown must fit in decay_steps")
        if self.muon_lr <= 0:
            raise UserError(f"optim.muon_lr={self.muon_lr} must be > 0")
        if not 0 <= self.muon_momentum < 1:
            raise UserError(f"optim.muon_momentum={self.muon_momentum} must be in [0, 1)")
        if self.muon_weight_decay < 0:
            raise UserError(f"optim.muon_weight_decay={self.muon_weight_decay} must be >= 0")


def decay_mask(params: Any) -> Any:
    """Decay only matmul kernels: never biases, norms or embeddings.

    Chosen by name, not rank: under `nn.scan` a norm scale is (L, C) and would look like a matrix.
    """
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({path: path[-1] == "kernel" for path in flat})


def muon_dimensions(path: tuple[str, ...], names: tuple[str | None, ...]) -> MuonDimensionNumbers | None:
    """How Muon sees one parameter (its path and logical axis names), or None where AdamW takes it.

    A hidden matrix is a kernel that reads from or writes to the residual stream ("embed") and is no
    embedding or head. Its "embed" axis is the input when it comes first (Q/K/V, MLP in) and the output when
    it comes last (attention out, MLP out); the other named axes are the matrix's other side, while the layer
    axis and a fused projection's unnamed Q/K/V axis index separate matrices, which Muon orthogonalises one
    by one.
    """
    if path[-1] != "kernel" or "embed" not in names or any(name in NOT_HIDDEN for name in names):
        return None
    matrix = [i for i, name in enumerate(names) if name not in STACKED]
    embed = names.index("embed")
    if embed == matrix[0]:
        return MuonDimensionNumbers(reduction_axis=(embed,), output_axis=tuple(matrix[1:]))
    if embed == matrix[-1]:
        return MuonDimensionNumbers(reduction_axis=tuple(matrix[:-1]), output_axis=(embed,))
    raise ValueError(f"{'/'.join(path)} {names}: 'embed' is neither its first nor its last matrix axis, so which "
                     "side is the input is unknown: give Muon's rule for it in jaxgpt.train.optim")


def _dimensions(axes: Any) -> dict[tuple[str, ...], MuonDimensionNumbers | None]:
    """`muon_dimensions` of every parameter, flat by path; `axes` is `nn.get_partition_spec` of the params."""
    return {path: muon_dimensions(path, tuple(spec)) for path, spec in traverse_util.flatten_dict(axes).items()}


def param_groups(axes: Any) -> Any:
    """The partition: MUON or ADAMW for every parameter, a tree shaped like the params."""
    return traverse_util.unflatten_dict({path: ADAMW if dims is None else MUON
                                         for path, dims in _dimensions(axes).items()})


def describe_groups(axes: Any, params: Any, cfg: OptimConfig) -> str:
    """One start-up line: each group's parameter count, leaves, roles and peak rate."""
    labels, sizes = traverse_util.flatten_dict(param_groups(axes)), traverse_util.flatten_dict(params)
    parts = []
    for group, roles, lr in ((MUON, "hidden matrices", cfg.muon_lr),
                             (ADAMW, "embeddings, head, norms, biases", cfg.lr)):
        paths = [path for path, label in labels.items() if label == group]
        count = sum(math.prod(sizes[path].shape) for path in paths)
        parts.append(f"{group} {count:,} parameters in {len(paths)} leaves ({roles}, lr {lr:g})")
    return "optimizer groups: " + "; ".join(parts)


def noam(factor: float, d_model: int, warmup_steps: int) -> optax.Schedule:
    """The Transformer paper's rate: linear warmup to factor / sqrt(d_model * warmup_steps) at update
    `warmup_steps`, then decay as 1 / sqrt(update). Updates count from 1, so step 0 is a real update."""

    def rate(count: jax.Array) -> jax.Array:
        n = jnp.asarray(count, jnp.float32) + 1.0
        return factor * d_model**-0.5 * jnp.minimum(n**-0.5, n * warmup_steps**-1.5)

    return rate


def cooldown_steps(cfg: OptimConfig) -> int:
    """The warmup-stable-decay schedule's cooldown length: the last cooldown_fraction of decay_steps."""
    return round(cfg.cooldown_fraction * cfg.decay_steps)


def one_minus_sqrt(init_value: float, end_value: float, steps: int) -> optax.Schedule:
    """init_value - (init_value - end_value) * sqrt(t / steps), held at end_value after `steps`: the cooldown
    of Hägele et al. 2024 ("Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations")."""

    def rate(count: jax.Array) -> jax.Array:
        done = jnp.clip(jnp.asarray(count, jnp.float32) / max(steps, 1), 0.0, 1.0)
        return init_value - (init_value - end_value) * jnp.sqrt(done)

    return rate


def wsd(cfg: OptimConfig, init_value: float) -> optax.Schedule:
    """Warmup-stable-decay: linear warmup to lr, lr held, then a linear or 1-sqrt cooldown to min_lr that ends
    at decay_steps. Unlike cosine, the rate stays at its peak for most of the run, so one run's checkpoint
    before the cooldown can be cooled down to any length."""
    cooldown = cooldown_steps(cfg)
    decay = (optax.linear_schedule(cfg.lr, cfg.min_lr, cooldown) if cfg.cooldown_shape == "linear"
             else one_minus_sqrt(cfg.lr, cfg.min_lr, cooldown))
    return optax.join_schedules([optax.linear_schedule(init_value, cfg.lr, cfg.warmup_steps),
                                 optax.constant_schedule(cfg.lr), decay],
                                boundaries=[cfg.warmup_steps, cfg.decay_steps - cooldown])


def schedule(cfg: OptimConfig, d_model: int | None = None) -> optax.Schedule:
    """`cfg.schedule`: linear warmup from lr/warmup to lr (above zero, so that step 0 is a real update), then
    cosine to min_lr at decay_steps, or held and cooled down (wsd); or Noam's, which scales by the model's width."""
    if cfg.schedule == "noam":
        if not d_model:
            raise ValueError("the noam schedule scales by the model's width: pass d_model")
        return noam(cfg.lr, d_model, cfg.warmup_steps)
    init = cfg.lr / max(cfg.warmup_steps, 1) if cfg.warmup_steps else cfg.lr
    if cfg.schedule == "wsd":
        return wsd(cfg, init)
    return optax.warmup_cosine_decay_schedule(init_value=init, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
                                              decay_steps=cfg.decay_steps, end_value=cfg.min_lr)


def scale_by_width(dims: Any) -> optax.GradientTransformation:
    """Muon's width factor sqrt(max(1, fan_out / fan_in)) per matrix (Keller Jordan's Muon): an orthogonalised
    update has unit spectral norm whatever its shape, and this keeps wide-output matrices' updates in
    proportion. `dims` is shaped like the (masked) updates, MuonDimensionNumbers at its leaves."""

    def scale(u: jax.Array, d: MuonDimensionNumbers) -> jax.Array:
        fan_in = math.prod(u.shape[a] for a in d.reduction_axis)
        fan_out = math.prod(u.shape[a] for a in d.output_axis)
        return u * math.sqrt(max(1.0, fan_out / fan_in))

    is_dims = lambda x: isinstance(x, MuonDimensionNumbers)
    return optax.stateless(lambda updates, _: jax.tree.map(scale, updates, dims, is_leaf=is_dims))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Gradients scaled by min(1, max_norm / their global norm), as PyTorch's `clip_grad_norm_` does: one factor,
    then a multiply. optax's version divides every element by the norm, and XLA:CPU does not copy a division into
    each of its consumers, so the clipped gradients were written out whole and read back by both Adam moments'
    fusions, and the update took twice as long (docs/benchmarks.md, "SmolLM2 against transformers"). The state is
    optax's (empty), so checkpoints restore either way."""

    def update(updates: Any, state: optax.EmptyState, params: Any = None) -> tuple[Any, optax.EmptyState]:
        factor = jnp.minimum(1.0, max_norm / optax.tree.norm(updates))
        return jax.tree.map(lambda g: g * factor.astype(g.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def _adamw(cfg: OptimConfig, d_model: int | None) -> optax.GradientTransformation:
    # The mask is a function: it must be static, or inject_hyperparams would call it as a schedule.
    return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=schedule(cfg, d_model), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
        mask=decay_mask)


def _muon(cfg: OptimConfig, d_model: int | None, axes: Any) -> optax.GradientTransformation:
    """optax.partition of the params: Muon (per-matrix orthogonalised Nesterov momentum, width-scaled, on
    muon_lr's schedule) for the hidden matrices, `_adamw` for the rest."""
    dims = _dimensions(axes)
    # Inside the partition Muon sees the params with every AdamW leaf masked out (optax.MaskedNode).
    muon_dims = traverse_util.unflatten_dict({path: optax.MaskedNode() if d is None else d
                                              for path, d in dims.items()})
    lr_schedule, ratio = schedule(cfg, d_model), cfg.muon_lr / cfg.lr
    muon = optax.chain(optax.contrib.scale_by_muon(beta=cfg.muon_momentum, weight_dimension_numbers=muon_dims),
                       scale_by_width(muon_dims), optax.add_decayed_weights(cfg.muon_weight_decay),
                       optax.scale_by_learning_rate(lambda count: lr_schedule(count) * ratio))
    return optax.partition({MUON: muon, ADAMW: _adamw(cfg, d_model)}, param_groups(axes))


def make_optimizer(cfg: OptimConfig, d_model: int | None = None, axes: Any = None) -> optax.GradientTransformation:
    """`d_model` (the model's width) is needed by the noam schedule only; `axes` (`nn.get_partition_spec` of
    the params: their logical axis names) by optimizer "muon" only, to tell its hidden matrices apart."""
    if cfg.optimizer == MUON:
        if axes is None:
            raise ValueError("optimizer 'muon' partitions the params by their logical axis names: pass axes")
        tx = _muon(cfg, d_model, axes)
    else:
        tx = _adamw(cfg, d_model)
    if cfg.grad_clip:
        return optax.chain(clip_by_global_norm(cfg.grad_clip), tx)
    return tx


def current_lr(opt_state: Any) -> jax.Array:
    """The learning rate used by the last update (inject_hyperparams keeps it in the state); with Muon,
    AdamW's (Muon's is muon_lr / lr times it)."""
    return optax.tree.get(opt_state, "learning_rate", filtering=lambda _, v: isinstance(v, jax.Array))
