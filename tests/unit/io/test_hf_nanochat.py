"""NanoChat import/export against transformers' own `NanoChatForCausalLM`, plus the refusals.

The comparisons need torch and a transformers that has NanoChat (5.x; CI's oldest lane pins transformers>=4.40,
which may not): they skip otherwise. The exact round trip and the one-line errors need only safetensors.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import user_error_line

pytest.importorskip("safetensors")

from helpers.models import assert_trees_equal

from jaxgpt.commands import hf as hf_command
from jaxgpt.generate import sampling
from jaxgpt.io import hf, weights
from jaxgpt.io.hf_tensors import CONFIG_FILE, SAFETENSORS_FILE
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import GPT, init_params, unstack_layers
from jaxgpt.model.presets import get_preset

pytestmark = pytest.mark.torch


def _has_nanochat() -> bool:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        return False
    import transformers

    return hasattr(transformers, "NanoChatForCausalLM")


needs_nanochat = pytest.mark.skipif(not _has_nanochat(), reason="torch and a transformers with NanoChat are needed")
TOL = 1e-4
# nanochat's option set at a tiny size, with grouped-query attention (2 key/value heads for 4 query heads).
NANO = ModelConfig(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, position="none",
                   rope_theta=100.0, norm="rmsnorm", norm_scale=False, norm_eps=1e-6, embd_norm=True, qk_norm=True,
                   activation="relu2", use_bias=False, tie_embeddings=False, logit_softcap=15.0, zero_init_proj=True)
# The other choices NanoChat's config.json leaves open: heads as wide as K = H (the fused qkv kernel), a head
# size that does not divide n_embd, a tied head, no soft-cap, another activation and epsilon.
VARIANTS = {
    "gqa": NANO,
    "tied-mha": NANO.replace(n_kv_head=None, head_dim=12, tie_embeddings=True, logit_softcap=None,
                             activation="gelu_tanh", norm_eps=1e-5, rope_theta=10000.0),
}


def noisy_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Initialized parameters plus noise: zero-initialized projections would leave the layers untested."""
    params = init_params(cfg, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys,
                                                                                                strict=True)])


@functools.cache
def _logits_fn(cfg: ModelConfig):
    return jax.jit(lambda p, idx: GPT(cfg).apply({"params": p}, idx))


def jax_logits(params: dict, cfg: ModelConfig, idx: np.ndarray) -> np.ndarray:
    return np.asarray(_logits_fn(cfg)(params, jnp.asarray(idx)))


def hf_logits(model, idx: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(idx)).logits.numpy()


def load_transformers(path: Path):
    from transformers import AutoModelForCausalLM, NanoChatForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert isinstance(model, NanoChatForCausalLM)
    return model


def random_ids(cfg: ModelConfig, batch: int, length: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(batch, length))


# ---------------------------------------------------------------------------------------------------
# Equivalence with transformers


@needs_nanochat
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_exported_logits_match_transformers(tmp_path, variant):
    cfg = VARIANTS[variant]
    params = noisy_params(cfg)
    hf.save_hf(params, cfg, tmp_path)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["model_type"] == "nanochat" and config["num_key_value_heads"] == cfg.n_kv_head
    idx = random_ids(cfg, batch=2, length=cfg.block_size)
    ours, theirs = jax_logits(params, cfg, idx), hf_logits(load_transformers(tmp_path), idx)
    assert np.abs(theirs).max() > 1.0  # the comparison is not between near-zero numbers
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOL)


@needs_nanochat
def test_transformers_checkpoint_imports(tmp_path):
    """A NanoChatForCausalLM born in transformers (GQA, untied, soft-capped), listed and scanned layers."""
    import torch
    from transformers import NanoChatConfig, NanoChatForCausalLM

    torch.manual_seed(0)
    rope = dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}, rope_theta=500.0)  # 5.x's, 4.x's
    config = NanoChatConfig(vocab_size=89, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                            num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=24,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None, **rope)
    model = NanoChatForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    params, cfg = hf.load_hf(tmp_path)
    assert (cfg.n_head, cfg.n_kv_head, cfg.d_ff, cfg.rope_theta, cfg.logit_softcap) == (6, 3, 80, 500.0, 15.0)
    idx = random_ids(cfg, batch=2, length=24)
    theirs = hf_logits(model, idx)
    np.testing.assert_allclose(jax_logits(params, cfg, idx), theirs, rtol=0, atol=TOL)
    scanned, scfg = hf.load_hf(tmp_path, scan_layers=True)
    np.testing.assert_allclose(jax_logits(scanned, scfg, idx), theirs, rtol=0, atol=TOL)


@needs_nanochat
def test_greedy_generate_matches_jaxgpt_sampling(tmp_path):
    """transformers' greedy `generate` on the export = jaxgpt's KV-cache sampler at temperature 0 (`sample.py`)."""
    import torch

    cfg = NANO
    params = noisy_params(cfg, seed=3)
    hf.save_hf(params, cfg, tmp_path)
    prompt = random_ids(cfg, batch=2, length=5, seed=2)
    theirs = load_transformers(tmp_path).generate(
        torch.as_tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long), max_new_tokens=20,
        do_sample=False, eos_token_id=None, pad_token_id=0).numpy()
    ours = sampling.generate(params, cfg, prompt, max_new_tokens=20, temperature=0.0)
    assert theirs.shape == (2, 25)
    np.testing.assert_array_equal(theirs[:, 5:], ours)


# ---------------------------------------------------------------------------------------------------
# Round trip, configs and refusals (no torch)


def test_roundtrip_is_exact_without_torch(tmp_path):
    cfg = NANO
    params = noisy_params(cfg, seed=4)
    hf.save_hf(params, cfg, tmp_path / "a")
    loaded, loaded_cfg = hf.load_hf(tmp_path / "a")
    assert loaded_cfg == cfg.replace(zero_init_proj=False)  # an init choice: not in the weights
    assert_trees_equal(loaded, params)
    assert weights.load(f"hf:{tmp_path / 'a'}").model == loaded_cfg  # the one loader's `hf:` source
    scanned, scfg = hf.load_hf(tmp_path / "a", scan_layers=True, block_size=16)
    assert scfg.block_size == 16
    assert_trees_equal(unstack_layers(scanned, scfg.n_layer), params)


def test_fine_tuning_keeps_a_context_beyond_gpt2s_1024(tmp_path):
    """The context limit comes from max_position_embeddings (NanoChat), not GPT-2's n_positions default."""
    cfg = NANO.replace(block_size=2048)
    params = noisy_params(cfg)
    hf.save_hf(params, cfg, tmp_path / "long")
    source = f"hf:{tmp_path / 'long'}"
    assert weights.load(source, block_size=2048).model.block_size == 2048
    assert weights.load(source, block_size=4096).model.block_size == 2048  # capped at the checkpoint's context
    assert weights.load(source, block_size=100).model.block_size == 100
    want = hf.load_hf(tmp_path / "long")[1]
    loaded = weights.load_for(source, want)  # what init_from=hf:DIR does at the weights' full context
    assert loaded.model.block_size == 2048
    assert_trees_equal(loaded.params, params)


def test_nanochat_d12_preset_exports_as_nanochat():
    config = hf.model_config_to_hf_config(get_preset("nanochat-d12"))
    assert config["architectures"] == ["NanoChatForCausalLM"]
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                                   "intermediate_size", "hidden_act", "final_logit_softcapping", "rms_norm_eps",
                                   "tie_word_embeddings")} == {
        "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 6, "head_dim": 128,
        "intermediate_size": 3072, "hidden_act": "relu2", "final_logit_softcapping": 15.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False}
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert config["bos_token_id"] is None and config["eos_token_id"] is None  # 65536 tokens, but not GPT-2's


def test_transformers_4_style_config_reads_rope_theta_and_defaults():
    cfg = hf.hf_config_to_model_config({"model_type": "nanochat", "vocab_size": 50, "hidden_size": 32,
                                        "num_attention_heads": 4, "rope_theta": 321.0, "rope_scaling": None})
    assert (cfg.rope_theta, cfg.n_kv_head, cfg.head_dim, cfg.d_ff, cfg.logit_softcap, cfg.tie_embeddings) == (
        321.0, 4, 8, 8192, 15.0, False)


@pytest.mark.parametrize("changes, named", [
    (dict(use_bias=True), "use_bias=True (NanoChat has no biases)"),
    (dict(norm_scale=True), "norm_scale=True (NanoChat's RMSNorms have no learned scale)"),
    (dict(qk_norm=False), "qk_norm=False"),
    (dict(embd_norm=False), "embd_norm=False"),
    (dict(norm="layernorm"), "norm='layernorm'"),
    (dict(rope_theta=None, position="learned"), "rope_theta=None"),
    (dict(norm_placement="post"), "norm_placement='post'"),
    (dict(pad_id=0), "pad_id=0"),
    (dict(qkv_bias=True), "qkv_bias=True"),
    (dict(qk_norm_site="before_rope"), "qk_norm_site='before_rope'"),
    (dict(sandwich_norm=True), "sandwich_norm=True"),
])
def test_export_refuses_what_nanochat_cannot_hold(tmp_path, changes, named):
    cfg = NANO.replace(**changes)
    message = user_error_line(hf.save_hf, init_params(cfg, jax.random.key(0)), cfg, tmp_path / "out")
    assert "cannot be exported as NanoChat" in message and named in message
    assert not (tmp_path / "out").exists()


def test_learned_positions_with_rotary_are_refused_by_the_config():
    assert "rotary positions replace position embeddings" in user_error_line(NANO.replace, position="learned")


@pytest.fixture()
def nano_checkpoint(tmp_path) -> Path:
    hf.save_hf(noisy_params(NANO), NANO, tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize("changes, named", [
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0}), "rotary scaling"),
    (dict(hidden_act="silu"), "hidden_act='silu'"),
    (dict(architectures=["NanoChatForCausalLM", "LlamaForCausalLM"]), "LlamaForCausalLM"),
    (dict(num_key_value_heads=3), "not a multiple of model.n_kv_head=3"),
])
def test_import_refuses_what_jaxgpt_cannot_compute(nano_checkpoint, changes, named):
    config = json.loads((nano_checkpoint / CONFIG_FILE).read_text())
    (nano_checkpoint / CONFIG_FILE).write_text(json.dumps({**config, **changes}))
    assert named in user_error_line(hf.load_hf, nano_checkpoint)


def test_import_names_a_missing_tensor(nano_checkpoint):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(nano_checkpoint / SAFETENSORS_FILE)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, nano_checkpoint / SAFETENSORS_FILE, metadata={"format": "pt"})
    assert "missing tensor 'model.layers.1.self_attn.k_proj.weight'" in user_error_line(hf.load_hf,
                                                                                    nano_checkpoint)


def test_cli_inspect_names_the_family(nano_checkpoint, capsys):
    assert hf_command.main(["jaxgpt hf", "inspect", str(nano_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "NanoChat checkpoint, all 14 tensors" in out and "n_kv_head      2" in out
