"""Optimizers and schedules: Muon's partition by role (GPT, scanned GPT, encoder-decoder), Muon on scanned
kernels as on the per-layer matrices, global-norm clipping against PyTorch's rule, warmup-stable-decay, z-loss,
one-line config errors, and a Muon run that resumes bit for bit."""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from helpers import load_tiny

from jaxgpt.errors import UserError
from jaxgpt.model import encdec, gpt
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig
from jaxgpt.ops.loss import chunked_cross_entropy
from jaxgpt.tasks.lm import LanguageModelling
from jaxgpt.train import optim
from jaxgpt.train.config import from_config_dict

TINY = ModelConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=50, block_size=16, tie_embeddings=False)
HIDDEN = ["attn/out/kernel", "attn/qkv/kernel", "mlp/fc/kernel", "mlp/proj/kernel"]


def axes_of(variables: dict) -> dict:
    return nn.get_partition_spec(variables["params"])


def muon_leaves(axes: dict) -> list[str]:
    flat = traverse_util.flatten_dict(optim.param_groups(axes))
    assert set(flat.values()) <= {optim.MUON, optim.ADAMW}
    return sorted("/".join(path) for path, group in flat.items() if group == optim.MUON)


def test_muon_takes_hidden_matrices_of_gpt_scanned_gpt_and_encdec() -> None:
    """Embeddings, the untied head, norms and biases go to AdamW; scanned 2-D norm scales and biases too."""
    assert muon_leaves(axes_of(gpt.abstract_variables(TINY))) == [f"h_{i}/{k}" for i in range(2) for k in HIDDEN]
    scanned = axes_of(gpt.abstract_variables(TINY.replace(scan_layers=True)))
    assert muon_leaves(scanned) == [f"h/{k}" for k in HIDDEN]
    dims = optim.muon_dimensions(("h", "attn", "qkv", "kernel"), tuple(scanned["h"]["attn"]["qkv"]["kernel"]))
    # (L, C, 3, H, D): C in, (H, D) out; L and the Q/K/V axis index separate matrices
    assert dims == optim.MuonDimensionNumbers(reduction_axis=(1,), output_axis=(3, 4))
    assert optim.muon_dimensions(("h", "attn", "out", "kernel"), ("layers", "heads", "head_dim", "embed")) == \
        optim.MuonDimensionNumbers(reduction_axis=(1, 2), output_axis=(3,))
    s2s = Seq2SeqConfig(model=TINY.replace(n_layer=1), n_encoder_layer=1, src_vocab_size=40, src_block_size=16)
    cross = ["cross/kv/kernel", "cross/out/kernel", "cross/q/kernel"]
    assert muon_leaves(axes_of(encdec.abstract_variables(s2s))) == sorted(
        [f"dec_0/{k}" for k in HIDDEN + cross] + [f"enc_0/{k}" for k in HIDDEN])
    classifier = gpt.abstract_variables(TINY, gpt.GPTClassifier(TINY, n_class=3))
    assert muon_leaves(axes_of(classifier)) == muon_leaves(axes_of(gpt.abstract_variables(TINY)))  # not cls_head


def test_muon_update_of_a_scanned_kernel_equals_per_layer_muon() -> None:
    """One update of the same parameters and gradients, scanned and per layer: equal leaf by leaf, and each
    hidden matrix orthogonalised (its singular values within Newton-Schulz's band around 1, times the rate)."""
    cfg = optim.OptimConfig(optimizer="muon", warmup_steps=1, decay_steps=10, muon_weight_decay=0.1)
    scanned_cfg = TINY.replace(scan_layers=True)
    shapes = traverse_util.flatten_dict(nn.unbox(gpt.abstract_variables(scanned_cfg)["params"]))
    rng = np.random.default_rng(0)  # numpy: eager jax.random would compile once per leaf shape
    params, grads = (traverse_util.unflatten_dict({path: (scale * rng.standard_normal(s.shape)).astype(np.float32)
                                                   for path, s in shapes.items()}) for scale in (0.02, 1.0))
    updates = {}
    for name, model_cfg, p, g in (("scanned", scanned_cfg, params, grads),
                                  ("layers", TINY, gpt.unstack_layers(params, 2), gpt.unstack_layers(grads, 2))):
        tx = optim.make_optimizer(cfg, axes=axes_of(gpt.abstract_variables(model_cfg)))
        updates[name] = jax.jit(lambda p, g, tx=tx: tx.update(g, tx.init(p), p)[0])(p, g)
    want = traverse_util.flatten_dict(updates["layers"])
    got = traverse_util.flatten_dict(gpt.unstack_layers(updates["scanned"], 2))
    assert want.keys() == got.keys()
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=1e-5, atol=1e-7, err_msg="/".join(path))
    rate_times_width = cfg.muon_lr * 2.0  # fc is (32, 128): sqrt(fan_out / fan_in) = 2
    singular = np.linalg.svd(want[("h_0", "mlp", "fc", "kernel")], compute_uv=False) / rate_times_width
    assert singular.min() > 0.5 and singular.max() < 1.5, singular


@pytest.mark.torch
@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e6])
def test_global_norm_clipping_is_pytorchs(max_norm: float) -> None:
    """Above max_norm the gradients scale to it, below they pass unchanged (the same arrays' values), as
    torch.nn.utils.clip_grad_norm_ leaves them; the state is optax's, so older checkpoints restore."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    grads = {"a": rng.standard_normal((64, 7)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    tx = optim.clip_by_global_norm(max_norm)
    clipped, state = tx.update(jax.tree.map(jnp.asarray, grads), tx.init(grads))
    tensors = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads.values()]
    for t, g in zip(tensors, grads.values(), strict=True):
        t.grad = torch.from_numpy(g.copy())
    torch.nn.utils.clip_grad_norm_(tensors, max_norm)
    for t, c in zip(tensors, clipped.values(), strict=True):
        np.testing.assert_allclose(np.asarray(c), t.grad.numpy(), rtol=1e-6, atol=0)
    unclipped = float(optax.tree.norm(grads))  # about 21: 0.5 and 3.0 clip, 1e6 passes them
    assert float(optax.tree.norm(clipped)) == pytest.approx(min(max_norm, unclipped), rel=1e-6)
    assert (unclipped <= max_norm) == (max_norm == 1e6)
    if unclipped <= max_norm:  # a factor of 1: the very values
        assert all(np.array_equal(np.asarray(clipped[k]), grads[k]) for k in grads)
    assert isinstance(state, optax.EmptyState)


def test_wsd_warms_up_holds_then_cools_down() -> None:
    base = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10, "decay_steps": 100, "schedule": "wsd",
            "cooldown_fraction": 0.2}
    linear = optim.schedule(optim.OptimConfig(**base))
    root = optim.schedule(optim.OptimConfig(**base, cooldown_shape="1-sqrt"))
    for sched in (linear, root):
        assert float(sched(0)) == pytest.approx(1e-4) and float(sched(5)) == pytest.approx(5.5e-4)
        assert [float(sched(n)) for n in (10, 50, 80)] == pytest.approx([1e-3] * 3)
        assert float(sched(100)) == pytest.approx(1e-4) and float(sched(500)) == pytest.approx(1e-4)
    assert float(linear(90)) == pytest.approx(5.5e-4) and float(linear(95)) == pytest.approx(3.25e-4)
    assert float(root(85)) == pytest.approx(1e-3 - 9e-4 * 0.5) and float(root(90)) == pytest.approx(
        1e-3 - 9e-4 * 0.5**0.5)


@pytest.mark.parametrize(("key", "value"), [("cooldown_fraction", -0.1), ("optimizer", "sgd"),
                                            ("schedule", "linear"), ("cooldown_shape", "cosine"), ("muon_lr", 0.0),
                                            ("muon_momentum", 1.0), ("muon_weight_decay", -1.0)])
def test_bad_optimizer_settings_are_one_line_errors_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(UserError, match=f"optim.{key}") as e:
        optim.OptimConfig(**{key: value})
    assert "\n" not in str(e.value)


def test_a_wsd_warmup_overlapping_its_cooldown_and_a_negative_z_loss_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"optim\.cooldown_fraction"):
        optim.OptimConfig(schedule="wsd", warmup_steps=90, decay_steps=100, cooldown_fraction=0.2)
    c = load_tiny(workdir=str(tmp_path), z_loss=-1.0)
    with pytest.raises(UserError, match=r"config\.z_loss"):
        from_config_dict(c)


def test_runs_saved_before_the_new_optimizer_keys_resume_at_their_defaults() -> None:
    from jaxgpt.train.resume import changed_keys

    older = {"optim.lr": 1e-3, "optim.schedule": "cosine"}
    now = {**older, "optim.optimizer": "adamw", "optim.cooldown_fraction": 0.2, "optim.muon_lr": 0.02}
    assert changed_keys(older, now) == []
    assert changed_keys(older, {**now, "optim.optimizer": "muon"}) == ["optim.optimizer"]


def test_z_loss_against_a_hand_computation(tmp_path: Path) -> None:
    """Chunked: cross-entropy + weight * mean(logsumexp^2) in float64 numpy. Dense, through the LM task:
    training adds it, evaluation does not."""
    h_BTC = jax.random.normal(jax.random.key(0), (2, 4, 3))
    w_CV = 3.0 * jax.random.normal(jax.random.key(1), (3, 5))
    y_BT = jnp.array([[0, 1, 2, 3], [4, 0, 1, 2]])
    logits = np.asarray(h_BTC, np.float64) @ np.asarray(w_CV, np.float64)
    lse = np.log(np.exp(logits).sum(-1))
    nll = lse - np.take_along_axis(logits, np.asarray(y_BT)[..., None], -1)[..., 0]
    got = chunked_cross_entropy(lambda h: h @ w_CV, h_BTC, y_BT, chunk=2, z_loss_weight=0.1)
    assert float(got) == pytest.approx(nll.mean() + 0.1 * (lse**2).mean(), rel=1e-5)

    c = load_tiny(workdir=str(tmp_path), z_loss=0.5)
    c.model.update(vocab_size=20, n_layer=1)
    task = LanguageModelling(from_config_dict(c), None)
    params = gpt.init_params(task.model_cfg, jax.random.key(0))
    batch = {"x": jax.random.randint(jax.random.key(2), (2, 32), 0, 20), "y": jnp.zeros((2, 32), jnp.int32)}

    @jax.jit
    def z_term_and_hand(params: dict) -> tuple[jax.Array, jax.Array]:
        lse_BT = jax.nn.logsumexp(task.model.apply({"params": params}, batch["x"]), axis=-1)
        return task.loss(params, batch, jax.random.key(3))[0] - task.evaluate(params, batch), jnp.mean(lse_BT**2)

    z_term, mean_lse_squared = z_term_and_hand(params)
    assert float(z_term) == pytest.approx(0.5 * float(mean_lse_squared), rel=1e-4)




