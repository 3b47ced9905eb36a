"""A float64 numpy reference of the GRPO loss variants (jaxgpt/tasks/rl/loss.py), its gradient worked out by hand.

The loss is a function of the logits through the completion tokens' log-probabilities at the rollouts' temperature,
logp = log_softmax(z / T)[y], whose gradient is (onehot(y) - softmax(z / T)) / T. A token's clipped surrogate
-min(r A, clip(r) A), r = exp(logp - old), has gradient -r A in logp where the unclipped term is the one taken (the
ratio inside the clip range, or outside it on the side that does not help), and 0 where the clip holds it; the k3
KL term beta (exp(ref - logp) - (ref - logp) - 1) has gradient beta (1 - exp(ref - logp)).
"""

from __future__ import annotations

import numpy as np


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def reduction_weights(mask_BW: np.ndarray, loss_type: str, max_new_tokens: int) -> np.ndarray:
    """Each token's weight in the loss: the sum of weight x token loss is the loss."""
    B = mask_BW.shape[0]
    if loss_type == "grpo":
        return mask_BW / (B * np.maximum(mask_BW.sum(axis=1, keepdims=True), 1.0))
    if loss_type == "dr_grpo":
        return mask_BW / (B * max_new_tokens)
    return mask_BW / max(mask_BW.sum(), 1.0)


def grpo_loss_and_grad(logits_BWV: np.ndarray, y_BW: np.ndarray, old_logp_BW: np.ndarray | None,
                       ref_logp_BW: np.ndarray | None, advantage_B: np.ndarray, mask_BW: np.ndarray, *,
                       loss_type: str, epsilon: float, epsilon_high: float, beta: float, temperature: float,
                       max_new_tokens: int) -> tuple[float, np.ndarray]:
    """(loss, d loss / d logits) in float64; `old_logp_BW` None: on-policy (ratio 1, its gradient stopped)."""
    z = np.asarray(logits_BWV, np.float64) / temperature
    logp_all = log_softmax(z)
    logp_BW = np.take_along_axis(logp_all, y_BW[..., None], axis=-1)[..., 0]
    old = logp_BW if old_logp_BW is None else np.asarray(old_logp_BW, np.float64)
    a = np.asarray(advantage_B, np.float64)[:, None]
    ratio = np.exp(logp_BW - old)
    low, high = 1.0 - epsilon, 1.0 + epsilon_high
    unclipped, clipped = ratio * a, np.clip(ratio, low, high) * a
    token = -np.minimum(unclipped, clipped)
    inside = (ratio >= low) & (ratio <= high)
    d_token = np.where(inside | (unclipped < clipped), -ratio * a, 0.0)
    if ref_logp_BW is not None and beta:
        delta = np.asarray(ref_logp_BW, np.float64) - logp_BW
        token = token + beta * (np.exp(delta) - delta - 1.0)
        d_token = d_token + beta * (1.0 - np.exp(delta))
    w = reduction_weights(np.asarray(mask_BW, np.float64), loss_type, max_new_tokens)
    loss = float((w * token).sum())
    onehot = np.eye(z.shape[-1])[y_BW]
    grad = (w * d_token)[..., None] * (onehot - np.exp(logp_all)) / temperature
    return loss, grad
