"""The preference losses of task dpo: DPO (sigmoid), IPO, hinge, and the reference-free SimPO and ORPO.

Each pair is a prompt with a chosen and a rejected reply; a reply's log-probability under a model is the sum of its
tokens' (`reply_logps`, the prompt's tokens count nothing). With pi the policy being trained and ref the frozen
starting model (its log-probabilities computed once before training, or live), and beta the strength:

* `sigmoid` (DPO): with h = (pi_c - pi_r) - (ref_c - ref_r), -log sigmoid(beta h); label smoothing eps (the
  "conservative" DPO of noisy labels) mixes in the flipped pair: -(1 - eps) log sigmoid(beta h) - eps log
  sigmoid(-beta h);
* `hinge`: max(0, 1 - beta h) (SLiC);
* `ipo`: (h - 1 / (2 beta))^2, h from per-token averaged log-probabilities (a reply's sum over its length, as TRL
  averages them for IPO);
* `simpo`: no reference; the averaged log-probabilities with a target margin gamma: -log sigmoid(beta (pi_c - pi_r)
  - gamma) (label smoothing as for sigmoid);
* `orpo`: no reference; the chosen reply's mean negative log-likelihood (per token, then per pair, as the paper's
  L_SFT) minus lambda log sigmoid(log odds(pi_c) - log odds(pi_r)), odds(p) = p / (1 - p) of the averaged
  log-probabilities. TRL averages the NLL over every chosen token of the batch instead: per pair, every loss here
  is a mean over pairs, so gradient accumulation over equal micro-batches equals the whole batch.

`rpo_alpha` (TRL's option of the same name, from the RPO paper) adds alpha x the chosen reply's mean negative
log-likelihood (per token, then per pair, as ORPO's) to any of them: DPO's loss alone may fall while the chosen reply
grows less likely as well as the rejected one, and the NLL term holds the chosen reply up.

The metrics are TRL's: rewards/chosen and rewards/rejected (beta (pi - ref), or beta pi without a reference, from
the log-probabilities the loss takes), rewards/accuracies (the share of pairs whose chosen reward is the higher),
rewards/margins, logps/chosen and logps/rejected (the policy's). tests/reference/numpy_reference_dpo.py is the
float64 reference of every loss (values and gradients through the logits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgpt.data.preferences import REFERENCE_FREE_LOSSES as REFERENCE_FREE
from jaxgpt.tasks.rl.loss import token_logprobs

AVERAGED = ("ipo", "simpo", "orpo")  # take each reply's log-probability per token (its sum over its length)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def reply_logps(logits_BWV: jax.Array, y_BW: jax.Array, mask_BW: jax.Array) -> jax.Array:
    """(B,) each row's sum of its reply tokens' log-probabilities (the targets `mask_BW` marks)."""
    return jnp.sum(token_logprobs(logits_BWV, y_BW, 1.0) * mask_BW, axis=-1)


def _log1m_exp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, accurate at both ends (x is clipped just below 0, where it is -inf)."""
    x = jnp.minimum(x, -1e-7)
    return jnp.where(x > -0.6931472, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def pair_losses(chosen_B: jax.Array, rejected_B: jax.Array, n_chosen_B: jax.Array, n_rejected_B: jax.Array,
                ref_chosen_B: jax.Array | None, ref_rejected_B: jax.Array | None, *, loss_type: str, beta: float,
                label_smoothing: float = 0.0, simpo_gamma: float = 0.5, orpo_lambda: float = 0.1,
                rpo_alpha: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(each pair's loss (B,), {name: (B,)}: the chosen and rejected rewards, whether the chosen one is the higher
    (1.0 or 0.0) and their margin, the log-probabilities, and ORPO's two terms (the NLL also with rpo_alpha): what
    the metrics average, held-out pairs per dataset too) from the replies' summed log-probabilities and
    token counts; the references are None for the reference-free losses."""
    nll_B = -chosen_B / jnp.maximum(n_chosen_B, 1.0)  # the chosen reply's mean negative log-likelihood per token
    if loss_type in AVERAGED:
        chosen_B, rejected_B = chosen_B / jnp.maximum(n_chosen_B, 1.0), rejected_B / jnp.maximum(n_rejected_B, 1.0)
        if loss_type == "ipo":
            ref_chosen_B = ref_chosen_B / jnp.maximum(n_chosen_B, 1.0)
            ref_rejected_B = ref_rejected_B / jnp.maximum(n_rejected_B, 1.0)
    terms: dict[str, jax.Array] = {}
    if loss_type in REFERENCE_FREE:
        chosen_reward_B, rejected_reward_B = beta * chosen_B, beta * rejected_B
        if loss_type == "simpo":
            h_B = beta * (chosen_B - rejected_B) - simpo_gamma
            loss_B = -(1 - label_smoothing) * jax.nn.log_sigmoid(h_B) - label_smoothing * jax.nn.log_sigmoid(-h_B)
        elif loss_type == "orpo":
            log_odds_B = (chosen_B - rejected_B) - (_log1m_exp(chosen_B) - _log1m_exp(rejected_B))
            ratio_B = jax.nn.log_sigmoid(log_odds_B)
            loss_B = nll_B - orpo_lambda * ratio_B
            terms = {"nll_loss": nll_B, "log_odds_ratio": ratio_B, "log_odds_chosen": log_odds_B}
        else:
            raise ValueError(f"unknown loss_type {loss_type!r}")
    else:
        chosen_reward_B, rejected_reward_B = beta * (chosen_B - ref_chosen_B), beta * (rejected_B - ref_rejected_B)
        h_B = (chosen_B - rejected_B) - (ref_chosen_B - ref_rejected_B)
        if loss_type == "sigmoid":
            loss_B = (-(1 - label_smoothing) * jax.nn.log_sigmoid(beta * h_B)
                      - label_smoothing * jax.nn.log_sigmoid(-beta * h_B))
        elif loss_type == "hinge":
            loss_B = jax.nn.relu(1.0 - beta * h_B)
        elif loss_type == "ipo":
            loss_B = (h_B - 1.0 / (2.0 * beta)) ** 2
        else:
            raise ValueError(f"unknown loss_type {loss_type!r}")
    if rpo_alpha:
        loss_B, terms = loss_B + rpo_alpha * nll_B, {"nll_loss": nll_B, **terms}
    stop = jax.lax.stop_gradient
    chosen_reward_B, rejected_reward_B = stop(chosen_reward_B), stop(rejected_reward_B)
    return loss_B, {"rewards/chosen": chosen_reward_B, "rewards/rejected": rejected_reward_B,
                    "rewards/accuracies": (chosen_reward_B > rejected_reward_B).astype(jnp.float32),
                    "rewards/margins": chosen_reward_B - rejected_reward_B,
                    "logps/chosen": stop(chosen_B), "logps/rejected": stop(rejected_B),
                    **{k: stop(v) for k, v in terms.items()}}


def summary(per_pair: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """TRL's metrics (and ORPO's terms): `pair_losses`'s per-pair values averaged over the pairs."""
    return {k: jnp.mean(v) for k, v in per_pair.items()}


def preference_loss(chosen_B: jax.Array, rejected_B: jax.Array, n_chosen_B: jax.Array, n_rejected_B: jax.Array,
                    ref_chosen_B: jax.Array | None, ref_rejected_B: jax.Array | None, **options: float | str
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the mean loss over the pairs, the metrics): `pair_losses` averaged."""
    loss_B, per_pair = pair_losses(chosen_B, rejected_B, n_chosen_B, n_rejected_B, ref_chosen_B, ref_rejected_B,
                                   **options)
    return jnp.mean(loss_B), summary(per_pair)
