"""Task dpo: the preference losses against a float64 reference, and preference data (its runs on the loop:
tests/integration/test_dpo_runs.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference.numpy_reference_dpo import dpo_loss_and_grad

from jaxgpt.data.preferences import DPO_LOSSES
from jaxgpt.tasks.dpo.loss import REFERENCE_FREE, preference_loss, reply_logps

OPTIONS = {"sigmoid": {"beta": 0.1}, "ipo": {"beta": 0.5}, "hinge": {"beta": 0.3},
           "simpo": {"beta": 2.0, "simpo_gamma": 0.5}, "orpo": {"beta": 0.1, "orpo_lambda": 0.2}}


def _pairs(rng: np.random.Generator, B: int = 5, W: int = 6, V: int = 7) -> tuple[np.ndarray, ...]:
    """Chosen and rejected rows: logits, targets, masks of replies of different lengths (one of 1 token)."""
    out = []
    for lengths in ([6, 3, 1, 4, 2], [2, 5, 3, 1, 6]):
        out += [rng.normal(size=(B, W, V)).astype(np.float32), rng.integers(0, V, (B, W)).astype(np.int32),
                (np.arange(W)[None] >= W - np.array(lengths)[:, None]).astype(np.float32)]
    return tuple(out)


def _jax_loss(logits_c, y_c, m_c, logits_r, y_r, m_r, ref_c, ref_r, **options):
    sums = reply_logps(logits_c, y_c, m_c), reply_logps(logits_r, y_r, m_r)
    return preference_loss(*sums, m_c.sum(1), m_r.sum(1), ref_c, ref_r, **options)


@pytest.mark.parametrize("loss_type", DPO_LOSSES)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_each_loss_equals_the_float64_reference_in_value_gradient_and_metrics(loss_type: str,
                                                                              label_smoothing: float) -> None:
    if label_smoothing and loss_type not in ("sigmoid", "simpo"):
        pytest.skip("label smoothing is an option of sigmoid and simpo")
    rng = np.random.default_rng(1)
    logits_c, y_c, m_c, logits_r, y_r, m_r = _pairs(rng)
    ref = None if loss_type in REFERENCE_FREE else [
        (np.asarray(reply_logps(jnp.asarray(z), jnp.asarray(y), jnp.asarray(m))) + rng.normal(scale=1.5, size=5))
        .astype(np.float32) for z, y, m in ((logits_c, y_c, m_c), (logits_r, y_r, m_r))]
    options = {"loss_type": loss_type, **OPTIONS[loss_type], "label_smoothing": label_smoothing}

    def loss(zc: jax.Array, zr: jax.Array) -> tuple[jax.Array, dict]:
        refs = (None, None) if ref is None else tuple(map(jnp.asarray, ref))
        return _jax_loss(zc, jnp.asarray(y_c), jnp.asarray(m_c), zr, jnp.asarray(y_r), jnp.asarray(m_r), *refs,
                         **options)

    (value, metrics), (grad_c, grad_r) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        jnp.asarray(logits_c), jnp.asarray(logits_r))
    want, want_c, want_r, want_metrics = dpo_loss_and_grad(logits_c, y_c, m_c, logits_r, y_r, m_r,
                                                           *(ref or (None, None)), **options)
    np.testing.assert_allclose(float(value), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_c), want_c, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad_r), want_r, rtol=1e-4, atol=1e-7)
    assert min(np.abs(want_c).max(), np.abs(want_r).max()) > 1e-3  # both sides of the pair are learnt from
    for name, v in want_metrics.items():
        np.testing.assert_allclose(float(metrics[name]), v, rtol=1e-5, atol=1e-6, err_msg=name)
    assert 0 < want_metrics["rewards/accuracies"] < 1  # the pairs disagree: the metric is not trivially 0 or 1


def test_at_the_reference_the_sigmoid_loss_is_ln_2_with_zero_margins() -> None:
    """Policy = reference (the first step of a run whose reference log-probabilities are the starting model's)."""
    logits_c, y_c, m_c, logits_r, y_r, m_r = map(jnp.asarray, _pairs(np.random.default_rng(2)))
    ref = reply_logps(logits_c, y_c, m_c), reply_logps(logits_r, y_r, m_r)
    loss, metrics = _jax_loss(logits_c, y_c, m_c, logits_r, y_r, m_r, *ref, loss_type="sigmoid", beta=0.1)
    assert float(loss) == pytest.approx(math.log(2), abs=1e-7) and np.float32(loss) == np.float32(0.6931472)
    assert float(metrics["rewards/margins"]) == 0.0 and float(metrics["rewards/chosen"]) == 0.0
    assert float(metrics["rewards/accuracies"]) == 0.0  # a tie is no win
