"""The GRPO objective: group-normalized advantages and the clipped policy-gradient loss on completion tokens.

Each prompt's G completions form a group; a completion's advantage is its reward less the group's mean, divided by
the group's standard deviation (`grpo`, `dapo`) or not (`dr_grpo`, which found the division biases updates toward
prompts that are almost always or almost never solved). Every completion token then gets PPO's clipped surrogate

    -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A),   ratio = pi(token) / pi_old(token)

plus `beta` times the k3 estimate of the KL divergence to the frozen starting model, exp(ref - logp) - (ref - logp)
- 1 (unbiased, and positive per token). pi_old is the policy that sampled the completions: with one update per
batch of rollouts it is the current policy with its gradient stopped (the ratio is 1 and the loss is REINFORCE
with a group baseline); with `num_iterations` > 1 updates it is the log-probability recorded when they were sampled.

The variants differ in how token losses become one number, which decides how long completions weigh:
`grpo` averages each completion's tokens, then the completions (a long completion's tokens count less); `dr_grpo`
sums them over a constant, rows x max_new_tokens (every token counts the same, whatever the lengths); `dapo`
averages over all completion tokens of the batch. With `beta` 0 the task runs no reference model at all (as TRL):
the KL is then neither a term nor a metric. tests/reference/numpy_reference_rl.py is the float64 reference of all three
(values and gradients).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.ops.loss import target_logit

ADVANTAGE_EPS = 1e-4  # added to a group's standard deviation: a group of equal rewards gets advantage 0, not NaN


def group_advantages(rewards_PG: np.ndarray, scale: bool) -> np.ndarray:
    """Each reward less its group's mean, over the group's standard deviation (ddof 1, as TRL) when `scale`."""
    rewards_PG = np.asarray(rewards_PG, np.float64)
    centered_PG = rewards_PG - rewards_PG.mean(axis=1, keepdims=True)
    if scale:
        centered_PG = centered_PG / (rewards_PG.std(axis=1, ddof=1, keepdims=True) + ADVANTAGE_EPS)
    return centered_PG.astype(np.float32)


def token_logprobs(logits_BWV: jax.Array, y_BW: jax.Array, temperature: float) -> jax.Array:
    """log pi(y) under the sampling distribution: the softmax of the logits over the rollouts' temperature."""
    logp_BWV = jax.nn.log_softmax(logits_BWV.astype(jnp.float32) / temperature, axis=-1)
    return target_logit(logp_BWV, y_BW)


def policy_loss(logp_BW: jax.Array, old_logp_BW: jax.Array | None, ref_logp_BW: jax.Array | None,
                advantage_B: jax.Array, mask_BW: jax.Array, *, loss_type: str, epsilon: float, epsilon_high: float,
                beta: float, max_new_tokens: int) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, {"clip_fraction", "kl"}) over the completion tokens (`mask_BW`). `old_logp_BW` None: on-policy (the
    current log-probabilities, gradient stopped); `ref_logp_BW` None: no reference (no KL term, no "kl")."""
    old_BW = jax.lax.stop_gradient(logp_BW) if old_logp_BW is None else old_logp_BW
    ratio_BW = jnp.exp(logp_BW - old_BW)
    a_B1 = advantage_B[:, None]
    clipped_BW = jnp.clip(ratio_BW, 1.0 - epsilon, 1.0 + epsilon_high)
    token_BW = -jnp.minimum(ratio_BW * a_B1, clipped_BW * a_B1)
    n_tokens = jnp.maximum(mask_BW.sum(), 1.0)
    kl: dict[str, jax.Array] = {}
    if ref_logp_BW is not None:
        delta_BW = ref_logp_BW - logp_BW
        kl_BW = jnp.exp(delta_BW) - delta_BW - 1.0
        kl["kl"] = jax.lax.stop_gradient((kl_BW * mask_BW).sum() / n_tokens)
        if beta:
            token_BW = token_BW + beta * kl_BW
    if loss_type == "grpo":
        loss = jnp.mean((token_BW * mask_BW).sum(axis=1) / jnp.maximum(mask_BW.sum(axis=1), 1.0))
    elif loss_type == "dr_grpo":
        loss = (token_BW * mask_BW).sum() / (mask_BW.shape[0] * max_new_tokens)
    elif loss_type == "dapo":
        loss = (token_BW * mask_BW).sum() / n_tokens
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    clip_BW = ((ratio_BW < 1.0 - epsilon) & (a_B1 < 0)) | ((ratio_BW > 1.0 + epsilon_high) & (a_B1 > 0))
    return loss, {"clip_fraction": (clip_BW * mask_BW).sum() / n_tokens, **kl}
