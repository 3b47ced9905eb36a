"""A float64 numpy reference of the preference losses (jaxgpt/tasks/dpo/loss.py), gradients worked out by hand.

A reply's log-probability is the sum over its tokens of log_softmax(z)[y] (the averaged losses divide it by the
reply's length), whose gradient in the logits is (onehot(y) - softmax(z)) per token. Each loss is a function of the
chosen and rejected values c and r per pair, averaged over pairs; its derivatives dL/dc and dL/dr are below.
"""

from __future__ import annotations

import numpy as np
from reference.numpy_reference_rl import log_softmax


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def _pair_loss(c: np.ndarray, r: np.ndarray, rc: np.ndarray | None, rr: np.ndarray | None, loss_type: str,
               beta: float, eps: float, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(loss per pair, dloss/dc, dloss/dr)."""
    if loss_type in ("sigmoid", "hinge", "ipo"):
        h = (c - r) - (rc - rr)
        if loss_type == "sigmoid":
            loss = -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h)
            dh = -(1 - eps) * beta * sigmoid(-beta * h) + eps * beta * sigmoid(beta * h)
        elif loss_type == "hinge":
            loss = np.maximum(0.0, 1.0 - beta * h)
            dh = np.where(1.0 - beta * h > 0, -beta, 0.0)
        else:
            loss = (h - 1.0 / (2.0 * beta)) ** 2
            dh = 2.0 * (h - 1.0 / (2.0 * beta))
        return loss, dh, -dh
    if loss_type == "simpo":
        x = beta * (c - r) - gamma
        loss = -(1 - eps) * log_sigmoid(x) - eps * log_sigmoid(-x)
        dx = -(1 - eps) * sigmoid(-x) + eps * sigmoid(x)
        return loss, beta * dx, -beta * dx
    # orpo: log odds o = (c - r) - (log(1 - e^c) - log(1 - e^r)); do/dc = 1 / (1 - e^c), do/dr = -1 / (1 - e^r)
    o = (c - r) - (np.log1p(-np.exp(c)) - np.log1p(-np.exp(r)))
    loss = -c - lam * log_sigmoid(o)
    do = -lam * sigmoid(-o)
    return loss, -1.0 + do / (1.0 - np.exp(c)), -do / (1.0 - np.exp(r))


def dpo_loss_and_grad(logits_cBWV: np.ndarray, y_cBW: np.ndarray, mask_cBW: np.ndarray, logits_rBWV: np.ndarray,
                      y_rBW: np.ndarray, mask_rBW: np.ndarray, ref_c: np.ndarray | None, ref_r: np.ndarray | None, *,
                      loss_type: str, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.5,
                      orpo_lambda: float = 0.1, rpo_alpha: float = 0.0
                      ) -> tuple[float, np.ndarray, np.ndarray, dict[str, float]]:
    """(mean loss, d loss / d chosen logits, d loss / d rejected logits, TRL's metrics), in float64; `ref_c` and
    `ref_r` are the reference's summed log-probabilities (None for simpo and orpo). `rpo_alpha` adds alpha x the
    chosen reply's mean NLL, -sum / n, whose derivative in the loss's own c (the sum, or the mean for the averaged
    losses) is -alpha / n / scale_c."""
    def logps(logits: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        all_ = log_softmax(np.asarray(logits, np.float64))
        return np.take_along_axis(all_, y[..., None], axis=-1)[..., 0], all_

    (tok_c, all_c), (tok_r, all_r) = logps(logits_cBWV, y_cBW), logps(logits_rBWV, y_rBW)
    mc, mr = np.asarray(mask_cBW, np.float64), np.asarray(mask_rBW, np.float64)
    scale_c = scale_r = np.ones(len(mc))
    if loss_type in ("ipo", "simpo", "orpo"):
        scale_c, scale_r = 1.0 / np.maximum(mc.sum(1), 1.0), 1.0 / np.maximum(mr.sum(1), 1.0)
    c, r = (tok_c * mc).sum(1) * scale_c, (tok_r * mr).sum(1) * scale_r
    if ref_c is not None:
        ref_c, ref_r = np.asarray(ref_c, np.float64), np.asarray(ref_r, np.float64)
        if loss_type == "ipo":
            ref_c, ref_r = ref_c * scale_c, ref_r * scale_r
    loss, dc, dr = _pair_loss(c, r, ref_c, ref_r, loss_type, beta, label_smoothing, simpo_gamma, orpo_lambda)
    n_c = np.maximum(mc.sum(1), 1.0)
    loss, dc = loss - rpo_alpha * (tok_c * mc).sum(1) / n_c, dc - rpo_alpha / n_c / scale_c
    B = len(c)

    def grad(d: np.ndarray, scale: np.ndarray, mask: np.ndarray, y: np.ndarray, all_: np.ndarray) -> np.ndarray:
        onehot = np.eye(all_.shape[-1])[y]
        return (d * scale / B)[:, None, None] * mask[..., None] * (onehot - np.exp(all_))

    rewards_c, rewards_r = (beta * c, beta * r) if ref_c is None else (beta * (c - ref_c), beta * (r - ref_r))
    metrics = {"rewards/chosen": rewards_c.mean(), "rewards/rejected": rewards_r.mean(),
               "rewards/accuracies": (rewards_c > rewards_r).mean(), "rewards/margins": (rewards_c - rewards_r).mean(),
               "logps/chosen": c.mean(), "logps/rejected": r.mean()}
    return (float(loss.mean()), grad(dc, scale_c, mc, y_cBW, all_c), grad(dr, scale_r, mr, y_rBW, all_r),
            {k: float(v) for k, v in metrics.items()})
