"""GPT-2 import/export against the real `transformers` implementation, plus the one-line errors.

Tests that need torch + transformers skip when they are absent; the error and round-trip tests that
only need safetensors always run (their checkpoints are written by jaxgpt's own exporter).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from helpers import user_error_line

pytest.importorskip("safetensors")

from helpers.models import assert_trees_equal, random_params
from safetensors.numpy import load_file, save_file

from jaxgpt.commands import hf as hf_command
from jaxgpt.io import hf, weights
from jaxgpt.io.hf_tensors import CONFIG_FILE, SAFETENSORS_FILE, TORCH_FILE
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import GPT, GPTClassifier, unstack_layers

pytestmark = pytest.mark.torch

HAVE_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch and transformers are not installed")
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers (which writes the exported tokenizer) is not installed")

# HF GPT2Config keyword sets, all small. "head24" is the 3-layer model with head size 96/4 = 24; "vocab50257"
# has GPT-2's real vocabulary and head size 64; the others vary activation, n_inner and epsilon.
HF_SIZES = {
    "head24": dict(vocab_size=101, n_positions=32, n_embd=96, n_layer=3, n_head=4),
    "vocab50257": dict(vocab_size=50257, n_positions=48, n_embd=128, n_layer=2, n_head=2),
    "gelu-ninner": dict(vocab_size=77, n_positions=24, n_embd=48, n_layer=1, n_head=6, n_inner=80,
                        activation_function="gelu", layer_norm_epsilon=1e-6),
    "relu": dict(vocab_size=64, n_positions=20, n_embd=40, n_layer=2, n_head=5, activation_function="relu"),
}
TOL = 1e-4
GPT2_SHAPED = ModelConfig(vocab_size=83, block_size=24, n_layer=2, n_head=4, n_embd=32)


@functools.cache
def _logits_fn(cfg: ModelConfig):
    return jax.jit(lambda p, idx: GPT(cfg).apply({"params": p}, idx))


def jax_logits(params: dict, cfg: ModelConfig, idx: np.ndarray) -> np.ndarray:
    return np.asarray(_logits_fn(cfg)(params, jnp.asarray(idx)))


def greedy(params: dict, cfg: ModelConfig, prompt: np.ndarray, steps: int) -> np.ndarray:
    """Greedy decoding by full recomputation. The sequence is padded to its final length so that one
    compiled shape serves every step: causal attention makes the padding invisible to earlier positions."""
    B, T0 = prompt.shape
    seq = np.zeros((B, T0 + steps), np.int64)
    seq[:, :T0] = prompt
    for t in range(T0, T0 + steps):
        seq[:, t] = jax_logits(params, cfg, seq)[:, t - 1].argmax(-1)
    return seq


def make_hf_model(size: str, seed: int = 0):
    """A randomly initialized GPT2LMHeadModel in eval mode. HF initializes biases to 0 and LayerNorm to
    (1, 0), which would leave half the mapping untested, so every tensor gets noise on top."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**HF_SIZES[size])).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # generate exactly the requested number of tokens
    return model


def hf_logits(model, idx: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(idx)).logits.numpy()


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """{size: (model, directory written by save_pretrained)}, built once for the module."""
    if not HAVE_TORCH:
        pytest.skip("torch and transformers are not installed")
    out = {}
    for size in HF_SIZES:
        model = make_hf_model(size)
        path = tmp_path_factory.mktemp(f"hf-{size}")
        model.save_pretrained(path)
        out[size] = (model, path)
    return out


def random_ids(cfg: ModelConfig, batch: int, length: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(batch, length))


# ---------------------------------------------------------------------------------------------------
# Equivalence with transformers


@needs_torch
@pytest.mark.parametrize("size", list(HF_SIZES))
def test_logits_match_transformers(hf_checkpoints, size):
    model, path = hf_checkpoints[size]
    params, cfg = hf.load_hf(path)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd) == (model.config.n_layer, model.config.n_head, model.config.n_embd)
    assert cfg.head_dim == model.config.n_embd // model.config.n_head
    idx = random_ids(cfg, batch=3, length=cfg.block_size)
    ours, theirs = jax_logits(params, cfg, idx), hf_logits(model, idx)
    assert np.abs(theirs).max() > 1.0  # the comparison is not between near-zero numbers
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOL)


@needs_torch
@pytest.mark.slow
def test_full_size_gpt2_small(tmp_path):
    """GPT-2 small's real shapes (124 M parameters, 12 x 12 heads of 64, 1024 positions), random weights."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    model.save_pretrained(tmp_path)
    params, cfg = hf.load_hf(tmp_path)
    assert cfg.replace(embd_dropout=0.0, attn_dropout=0.0, resid_dropout=0.0) == hf.hf_config_to_model_config(
        {"model_type": "gpt2"}, embd_dropout=0.0, attn_dropout=0.0, resid_dropout=0.0)
    idx = random_ids(cfg, batch=2, length=128)
    np.testing.assert_allclose(jax_logits(params, cfg, idx), hf_logits(model, idx), rtol=0, atol=TOL)


@needs_torch
@pytest.mark.parametrize("size", ["head24", "vocab50257"])
def test_greedy_generation_matches_transformers(hf_checkpoints, size):
    import torch

    model, path = hf_checkpoints[size]
    params, cfg = hf.load_hf(path)
    prompt = random_ids(cfg, batch=2, length=5, seed=2)
    theirs = model.generate(torch.as_tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                            max_new_tokens=20, do_sample=False, pad_token_id=0).numpy()
    ours = greedy(params, cfg, prompt, steps=20)
    assert theirs.shape == (2, 25)
    np.testing.assert_array_equal(ours, theirs)


@needs_torch
def test_scanned_load_matches(hf_checkpoints):
    model, path = hf_checkpoints["head24"]
    params, cfg = hf.load_hf(path, scan_layers=True)
    assert cfg.scan_layers and params["h"]["attn"]["qkv"]["kernel"].shape == (3, 96, 3, 4, 24)
    idx = random_ids(cfg, batch=2, length=16)
    np.testing.assert_allclose(jax_logits(params, cfg, idx), hf_logits(model, idx), rtol=0, atol=TOL)


@needs_torch
def test_cropped_block_size(hf_checkpoints):
    model, path = hf_checkpoints["head24"]
    params, cfg = hf.load_hf(path, block_size=16)
    assert cfg.block_size == 16 and params["wpe"]["embedding"].shape == (16, 96)
    idx = random_ids(cfg, batch=2, length=16)
    np.testing.assert_allclose(jax_logits(params, cfg, idx), hf_logits(model, idx), rtol=0, atol=TOL)
    assert "1..32" in user_error_line(hf.load_hf, path, block_size=64)


@needs_torch
def test_pytorch_model_bin_layout(hf_checkpoints, tmp_path):
    """The pickle layout with the original OpenAI names (no "transformer." prefix, causal-mask buffers).

    transformers 5 writes safetensors even with safe_serialization=False, so the file is written with
    torch.save, which is what that option used to do."""
    import torch

    model, _ = hf_checkpoints["head24"]
    state = {k.removeprefix("transformer."): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for i in range(model.config.n_layer):  # buffers that old checkpoints carry and the loader must ignore
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    torch.save(state, tmp_path / TORCH_FILE)
    (tmp_path / CONFIG_FILE).write_text(json.dumps(model.config.to_dict()))
    params, cfg = hf.load_hf(tmp_path)
    idx = random_ids(cfg, batch=2, length=32)
    np.testing.assert_allclose(jax_logits(params, cfg, idx), hf_logits(model, idx), rtol=0, atol=TOL)


@needs_torch
def test_bfloat16_checkpoint_loads(tmp_path):
    """bfloat16 tensors are read torch-free (ml_dtypes' bfloat16); the weights arrive in param_dtype, float32."""
    import torch

    model = make_hf_model("relu").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    params, cfg = hf.load_hf(tmp_path)
    assert params["wte"]["embedding"].dtype == jnp.float32
    idx = random_ids(cfg, batch=2, length=20)
    np.testing.assert_allclose(jax_logits(params, cfg, idx), hf_logits(model.float(), idx), rtol=0, atol=TOL)


@needs_torch
def test_untied_checkpoint_loads(tmp_path):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    model = GPT2LMHeadModel(GPT2Config(**HF_SIZES["relu"], tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
    model.save_pretrained(tmp_path)
    params, cfg = hf.load_hf(tmp_path)
    assert not cfg.tie_embeddings and params["lm_head"]["kernel"].shape == (40, 64)
    idx = random_ids(cfg, batch=2, length=20)
    np.testing.assert_allclose(jax_logits(params, cfg, idx), hf_logits(model, idx), rtol=0, atol=TOL)


# ---------------------------------------------------------------------------------------------------
# Round trips


@needs_torch
@pytest.mark.parametrize("size", ["head24", "gelu-ninner"])
def test_export_roundtrip_through_transformers(hf_checkpoints, tmp_path, size):
    from transformers import GPT2LMHeadModel

    model, path = hf_checkpoints[size]
    params, cfg = hf.load_hf(path)
    hf.save_hf(params, cfg, tmp_path / "out")
    again, cfg_again = hf.load_hf(tmp_path / "out")
    assert cfg_again == cfg
    assert_trees_equal(again, params)
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    idx = random_ids(cfg, batch=2, length=cfg.block_size, seed=5)
    np.testing.assert_allclose(hf_logits(reloaded, idx), hf_logits(model, idx), rtol=0, atol=1e-6)
    np.testing.assert_allclose(hf_logits(reloaded, idx), jax_logits(params, cfg, idx), rtol=0, atol=TOL)


@needs_torch
def test_jaxgpt_model_exports_to_transformers(tmp_path):
    """A model born in jaxgpt (with scanned layers and noisy biases) gives the same logits in transformers."""
    from transformers import GPT2LMHeadModel

    cfg = GPT2_SHAPED.replace(scan_layers=True, activation="gelu")
    params = random_params(cfg, seed=0, std=0.05)
    hf.save_hf(params, cfg, tmp_path)
    idx = random_ids(cfg, batch=2, length=24)
    theirs = hf_logits(GPT2LMHeadModel.from_pretrained(tmp_path).eval(), idx)
    np.testing.assert_allclose(theirs, jax_logits(params, cfg, idx), rtol=0, atol=TOL)


def test_roundtrip_without_torch(tmp_path):
    """export -> import is exact, for unscanned and scanned trees, and needs only numpy + safetensors."""
    cfg = GPT2_SHAPED
    params = random_params(cfg, seed=1, std=0.05)
    hf.save_hf(params, cfg, tmp_path / "a")
    loaded, loaded_cfg = hf.load_hf(tmp_path / "a", attn_dropout=0.0, embd_dropout=0.0, resid_dropout=0.0)
    assert loaded_cfg == cfg
    assert_trees_equal(loaded, params)
    scanned, scfg = hf.load_hf(tmp_path / "a", scan_layers=True)
    assert_trees_equal(unstack_layers(scanned, scfg.n_layer), params)
    hf.save_hf(scanned, scfg, tmp_path / "b")
    assert_trees_equal(load_file(tmp_path / "b" / SAFETENSORS_FILE), load_file(tmp_path / "a" / SAFETENSORS_FILE))


def test_loaded_params_initialize_a_classifier(tmp_path):
    cfg = GPT2_SHAPED
    hf.save_hf(random_params(cfg, seed=2, std=0.05), cfg, tmp_path)
    params, cfg = hf.load_hf(tmp_path)
    clf = GPTClassifier(cfg, n_class=3, cls_token_id=5)
    idx = random_ids(cfg, batch=2, length=10)
    shapes = jax.eval_shape(clf.init, jax.random.key(3), idx)["params"]
    merged = {**params, "cls_head": {"kernel": jnp.ones((32, 3)), "bias": jnp.zeros(3)}}
    assert jax.tree.structure(merged) == jax.tree.structure(nn.unbox(shapes))
    lm_logits, cls_logits = jax.jit(clf.apply)({"params": merged}, idx)
    np.testing.assert_allclose(lm_logits, jax_logits(params, cfg, idx), rtol=0, atol=1e-6)
    assert cls_logits.shape == (2, 3)


# ---------------------------------------------------------------------------------------------------
# Errors: one line, naming what is wrong


@pytest.fixture()
def good_checkpoint(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    hf.save_hf(random_params(GPT2_SHAPED, seed=4, std=0.05), GPT2_SHAPED, path)
    return path


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / CONFIG_FILE).read_text())
    config.update(changes)
    (path / CONFIG_FILE).write_text(json.dumps(config))


def test_error_missing_directory(tmp_path):
    assert "does not exist" in user_error_line(hf.load_hf, tmp_path / "nope")


def test_error_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    assert "not a Hugging Face checkpoint: it has no config.json" in user_error_line(hf.load_hf, tmp_path)


def test_error_no_weights(good_checkpoint):
    (good_checkpoint / SAFETENSORS_FILE).unlink()
    message = user_error_line(hf.load_hf, good_checkpoint)
    assert "no weights" in message and SAFETENSORS_FILE in message


@pytest.mark.parametrize("changes, named", [
    (dict(model_type="falcon", architectures=["FalconForCausalLM"]), "'falcon' model"),
    (dict(architectures=["BertForMaskedLM"]), "BertForMaskedLM"),
    (dict(activation_function="swish"), "activation_function='swish'"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
])
def test_error_not_gpt2_architecture(good_checkpoint, changes, named):
    edit_config(good_checkpoint, **changes)
    assert named in user_error_line(hf.load_hf, good_checkpoint)


def test_error_missing_tensor(good_checkpoint):
    file = good_checkpoint / SAFETENSORS_FILE
    tensors = load_file(file)
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors, file, metadata={"format": "pt"})
    assert "missing tensor 'transformer.h.1.mlp.c_fc.bias'" in user_error_line(hf.load_hf, good_checkpoint)


def test_error_shape_mismatch(good_checkpoint):
    edit_config(good_checkpoint, n_positions=32)  # the file's wpe has 24 rows
    message = user_error_line(hf.load_hf, good_checkpoint)
    assert "'transformer.wpe.weight' has shape (24, 32), but config.json implies (32, 32)" in message


def test_error_bin_without_torch(good_checkpoint, monkeypatch):
    (good_checkpoint / SAFETENSORS_FILE).rename(good_checkpoint / TORCH_FILE)
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail
    message = user_error_line(hf.load_hf, good_checkpoint)
    assert "need torch" in message and "install torch" in message


def test_error_size_override(good_checkpoint):
    assert "n_layer" in user_error_line(hf.load_hf, good_checkpoint, n_layer=4)


def test_n_inner_follows_the_config_rule():
    """n_inner absent or None <-> d_ff derived from n_embd by ModelConfig's rule; other widths are explicit."""
    derived = hf.hf_config_to_model_config({"model_type": "gpt2", "n_embd": 48, "n_head": 6})
    assert derived.d_ff == 192 and derived.is_derived("d_ff") and derived.settings()["d_ff"] is None
    assert hf.model_config_to_hf_config(derived)["n_inner"] is None
    wide = hf.hf_config_to_model_config({"model_type": "gpt2", "n_embd": 48, "n_head": 6, "n_inner": 80})
    assert wide.d_ff == 80 and hf.model_config_to_hf_config(wide)["n_inner"] == 80
    assert "n_inner=0" in user_error_line(hf.hf_config_to_model_config, {"model_type": "gpt2", "n_inner": 0})


@pytest.mark.parametrize("changes, named", [
    (dict(norm_placement="post", final_norm=False), "norm_placement='post'"),
    (dict(position="sinusoidal"), "position='sinusoidal'"),
    (dict(tie_embeddings=False), "tie_embeddings=False"),
    (dict(norm="unbiased_std"), "norm='unbiased_std'"),
    (dict(head_dim=16), "head_dim*n_head=16*4 != n_embd=32"),
    (dict(use_bias=False), "use_bias=False"),
    (dict(pad_positions=True), "pad_positions=True"),
    (dict(gated_mlp=True), "gated_mlp=True"),
    (dict(sliding_window=8), "sliding_window=8"),
    (dict(attn_softcap=30.0), "attn_softcap=30.0"),
    (dict(qkv_bias=False), "qkv_bias=False"),
])
def test_export_refuses_non_gpt2_configs(tmp_path, changes, named):
    cfg = GPT2_SHAPED.replace(**changes)
    params = random_params(cfg, seed=0, std=0.05)
    message = user_error_line(hf.save_hf, params, cfg, tmp_path / "out")
    assert "cannot be exported as GPT-2" in message and named in message
    assert not (tmp_path / "out").exists()


def test_export_never_overwrites_by_default(good_checkpoint):
    before = (good_checkpoint / SAFETENSORS_FILE).read_bytes()
    params = random_params(GPT2_SHAPED, seed=9, std=0.05)
    assert "not empty" in user_error_line(hf.save_hf, params, GPT2_SHAPED, good_checkpoint)
    assert (good_checkpoint / SAFETENSORS_FILE).read_bytes() == before
    (good_checkpoint / TORCH_FILE).write_bytes(b"stale")
    hf.save_hf(params, GPT2_SHAPED, good_checkpoint, overwrite=True)
    assert not (good_checkpoint / TORCH_FILE).exists()
    assert_trees_equal(hf.load_hf(good_checkpoint)[0], params)


# ---------------------------------------------------------------------------------------------------
# Command line


def test_cli_inspect_and_errors(good_checkpoint, tmp_path, capsys):
    assert hf_command.main(["jaxgpt hf", "inspect", str(good_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "GPT-2 checkpoint" in out and "n_layer        2" in out
    assert hf_command.main(["jaxgpt hf", "inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


@needs_transformers
def test_cli_export(tmp_path, monkeypatch, capsys):
    """Exports what `weights.load("workdir:...")` returns (faked here: the training side is tested elsewhere),
    leaving out a classifier head."""
    cfg = GPT2_SHAPED
    params = random_params(cfg, seed=6, std=0.05)
    with_head = {**params, "cls_head": {"kernel": jnp.zeros((32, 2)), "bias": jnp.zeros(2)}}
    asked = []

    def fake_load(source, which="latest", **_):
        asked.append((source, which))
        return weights.Weights(with_head, cfg, None, {}, "run")

    monkeypatch.setattr(weights, "load", fake_load)
    export = ["jaxgpt hf", "export", "--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "out")]
    assert hf_command.main(export) == 0
    assert "left out cls_head" in capsys.readouterr().out
    assert_trees_equal(hf.load_hf(tmp_path / "out")[0], params)
    assert hf_command.main([*export, "--which", "best"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert asked == [(f"workdir:{tmp_path / 'run'}", "latest"), (f"workdir:{tmp_path / 'run'}", "best")]


