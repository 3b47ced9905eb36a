"""QLoRA's quantized base (`jaxgpt.model.quant`): int8 per channel and NF4 per group within their error bounds, a
quantized model close to the float one, and adapters on it that train."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.models import prompts, random_params
from test_lora import MODELS, sites_of

from jaxgpt.errors import UserError
from jaxgpt.model import lora, quant
from jaxgpt.model.gpt import GPT, abstract_variables

rng = np.random.default_rng(0)


def test_int8_per_channel_error_is_within_half_a_step() -> None:
    w = rng.normal(size=(2, 32, 3, 4, 8)).astype(np.float32)  # scanned (L, C, 3, H, D)
    q = quant.quantize(w, 1, 1, "int8", 64)
    assert q["kernel_q"].dtype == np.int8 and q["kernel_q"].shape == (2, 32, 96)
    assert q["kernel_scale"].shape == (2, 1, 96)
    back = np.asarray(quant.dequantize(jnp.asarray(q["kernel_q"]), jnp.asarray(q["kernel_scale"]), w.shape))
    step = np.abs(w).reshape(2, 32, 96).max(axis=1) / 127  # per layer and output channel
    assert (np.abs(back - w).reshape(2, 32, 96) <= step[:, None] / 2 + 1e-7).all()


def test_nf4_codes_are_the_code_book_and_the_error_within_half_its_widest_gap() -> None:
    assert len(quant.NF4) == 16 and quant.NF4[7] == 0 and quant.NF4[0] == -1 and quant.NF4[-1] == 1
    assert (np.diff(quant.NF4) > 0).all()
    w = rng.normal(size=(128, 40)).astype(np.float32)
    q = quant.quantize(w, 0, 1, "nf4", 32)
    assert q["kernel_q"].dtype == np.uint8 and q["kernel_q"].shape == (64, 40) and q["kernel_scale"].shape == (4, 40)
    back = np.asarray(quant.dequantize(jnp.asarray(q["kernel_q"]), jnp.asarray(q["kernel_scale"]), w.shape))
    absmax = np.abs(w).reshape(4, 32, 40).max(axis=1, keepdims=True)
    normalized = (back.reshape(4, 32, 40) / absmax).ravel()
    assert np.isin(np.round(normalized, 5), np.round(quant.NF4, 5)).all()  # every value a level of the code book
    gap = np.diff(quant.NF4).max() / 2
    assert (np.abs(back - w).reshape(4, 32, 40) <= gap * absmax + 1e-6).all()
    nearest = np.abs(w.reshape(4, 32, 40) / absmax - quant.NF4[:, None, None, None]).min(axis=0)
    np.testing.assert_allclose(np.abs(normalized.reshape(4, 32, 40) - w.reshape(4, 32, 40) / absmax), nearest,
                               atol=1e-6)  # the nearest level, not merely a close one


@pytest.mark.parametrize(("kind", "bound"), [("int8", 0.02), ("nf4", 0.25)])
@pytest.mark.parametrize("name", ["fused", "scanned", "gated-untied"])
def test_a_quantized_model_is_close_to_the_float_one(name: str, kind: str, bound: float) -> None:
    cfg = MODELS[name]
    base, tokens = random_params(cfg, std=0.05), prompts(cfg, 8)
    q, axes = quant.quantize_base(jax.device_get(base), abstract_variables(cfg)["params"], kind, 16)
    layer = q["h"] if cfg.scan_layers else q["h_0"]
    assert "kernel" not in layer["mlp"]["fc"] and "kernel_q" in layer["mlp"]["fc"]
    assert jax.tree.structure(q) == jax.tree.structure(axes, is_leaf=lambda x: x is None or hasattr(x, "index"))
    model = GPT(cfg)
    full = np.asarray(model.apply({"params": base}, tokens))
    approx = np.asarray(model.apply({"params": q}, tokens))
    rel = np.abs(approx - full).max() / np.abs(full).max()
    assert 0 < rel < bound, rel
    back = quant.dequantize_base(q, abstract_variables(cfg)["params"])
    np.testing.assert_allclose(np.asarray(model.apply({"params": back}, tokens)), approx, rtol=1e-4, atol=1e-4)


def test_adapters_on_a_4bit_base_train() -> None:
    cfg = MODELS["gated-untied"]
    base = jax.device_get(random_params(cfg, std=0.05))
    q, _ = quant.quantize_base(base, abstract_variables(cfg)["params"], "nf4", 16)
    adapters = nn.unbox(lora.init_adapters(sites_of(cfg), jax.random.key(0)))
    tokens = prompts(cfg, 9, batch=4)
    model, tx = GPT(cfg), optax.adam(1e-2)

    @jax.jit
    def step(adapters, opt):
        def loss(a):
            logits = model.apply({"params": lora.overlay(q, a, 2.0)}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        value, grads = jax.value_and_grad(loss)(adapters)
        updates, opt = tx.update(grads, opt)
        return optax.apply_updates(adapters, updates), opt, value

    opt, losses = tx.init(adapters), []
    for _ in range(20):
        adapters, opt, value = step(adapters, opt)
        losses.append(float(value))
    assert losses[-1] < 0.8 * losses[0], losses


def test_a_group_size_that_does_not_divide_is_one_line() -> None:
    cfg = MODELS["fused"]
    with pytest.raises(UserError, match="does not divide") as e:
        quant.quantize_base(jax.device_get(random_params(cfg)), abstract_variables(cfg)["params"], "nf4", 6)
    assert "\n" not in str(e.value)
