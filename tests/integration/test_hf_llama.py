"""Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (text) from and to transformers' own classes, plus the refusals.

Each family is a tiny random model made by transformers (its config class, `save_pretrained`, float32) with its
quirk exercised: Llama with llama3 RoPE scaling, Mistral with a 64-token window, Qwen2 with q/k/v biases, Qwen3
with QK-norm and yarn, Gemma 3 with (1 + w) norms, sandwich norms, a final soft-cap, a query scale, linear scaling
on its global layers and a window smaller than the input on the others. Every parameter is redrawn at a scale where
each quirk moves the logits (transformers zeroes biases and Gemma's w at init), and `test_each_quirk_matters`
shows that removing it breaks the 1e-4 agreement.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import user_error_line
from helpers.models import assert_trees_equal

from jaxgpt.generate import sampling
from jaxgpt.io import hf, weights
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import GPT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.torch
TOL = 1e-4
LENGTH = 520  # tokens of input: past llama3's and yarn's original context and past every window
SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=640, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=64, num_key_value_heads=4, head_dim=12)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128})),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, sliding_window_pattern=2, sliding_window=48, head_dim=16, query_pre_attn_scalar=24,
        final_logit_softcapping=15.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


def _redraw(model) -> None:
    """Every parameter at a scale where it matters: matrices ~ 1/sqrt(fan_in), embeddings ~ 1, norm scales and
    biases around 0.5 (w and 1 + w then differ, a zero bias would not)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" in name:
                p.normal_(0.0, 1.0)
            elif p.ndim == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            else:
                p.normal_(0.5, 0.3)


@functools.cache
def _checkpoint(family: str, root: str) -> tuple[object, str]:
    """(transformers model, its save_pretrained directory) of one family, made once per session."""
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SIZES, **extra})
    model = getattr(transformers, model_class)(config).eval()
    _redraw(model)
    path = f"{root}/{family}"
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hf_llama"))


@functools.cache
def _logits_fn(cfg: ModelConfig):
    return jax.jit(lambda p, idx: GPT(cfg).apply({"params": p}, idx))


def jax_logits(params, cfg: ModelConfig, idx: np.ndarray) -> np.ndarray:
    return np.asarray(_logits_fn(cfg)(params, jnp.asarray(idx)))


def hf_logits(model, idx: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(idx)).logits.numpy()


def _config(path: str) -> dict:
    return json.loads(Path(path, "config.json").read_text())


def ids(length: int = LENGTH, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, SIZES["vocab_size"], size=(1, length))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(root, family):
    model, path = _checkpoint(family, root)
    params, cfg = hf.load_hf(path)
    idx = ids()
    theirs = hf_logits(model, idx)
    assert np.abs(theirs).max() > 1.0  # the comparison is not between near-zero numbers
    np.testing.assert_allclose(jax_logits(params, cfg, idx), theirs, rtol=0, atol=TOL)


# What each family adds, and the config without it: the logits must then disagree.
QUIRKS = {
    "llama": lambda cfg, p: (cfg.replace(rope_scaling=None), p),
    "mistral": lambda cfg, p: (cfg.replace(sliding_window=None), p),
    "qwen2": lambda cfg, p: (cfg, jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if path[-1].key == "bias" else x, p)),
    "qwen3": lambda cfg, p: (cfg.replace(rope_scaling=None), p),
    "gemma3_text": lambda cfg, p: (cfg.replace(norm_scale_offset=0.0), p),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_quirk_matters(root, family):
    """The equivalence above can fail: without the family's quirk, the logits are off by far more than 1e-4."""
    model, path = _checkpoint(family, root)
    params, cfg = hf.load_hf(path)
    cfg, params = QUIRKS[family](cfg, params)
    idx = ids()
    assert np.abs(jax_logits(params, cfg, idx) - hf_logits(model, idx)).max() > 100 * TOL


def test_gemma_window_and_pattern_are_read(root):
    _, path = _checkpoint("gemma3_text", root)
    cfg = hf.load_hf(path)[1]
    assert (cfg.sliding_window, cfg.window_pattern, cfg.rope_local_theta) == (48, 2, 10000.0)
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.query_scale) == ("linear", 2.0, 24 ** -0.5)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_greedy_generation_matches_transformers(root, family):
    model, path = _checkpoint(family, root)
    params, cfg = hf.load_hf(path)
    prompt = ids(40, seed=2)
    theirs = model.generate(torch.as_tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                            max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0).numpy()
    ours = sampling.generate(params, cfg, prompt, max_new_tokens=16, temperature=0.0)
    np.testing.assert_array_equal(theirs[:, 40:], ours)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_round_trip_is_exact(root, tmp_path, family):
    model, path = _checkpoint(family, root)
    params, cfg = hf.load_hf(path)
    hf.save_hf(params, cfg, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == family
    again, again_cfg = hf.load_hf(tmp_path / "out")
    assert again_cfg == cfg
    assert_trees_equal(again, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    idx = ids(80, seed=3)
    np.testing.assert_allclose(hf_logits(reloaded, idx), hf_logits(model, idx), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Refusals: one line each


def test_bad_directories_and_configs_are_one_line(root, tmp_path):
    _, path = _checkpoint("llama", root)
    config = _config(path)
    (tmp_path / "empty").mkdir()
    assert "no config.json" in user_error_line(hf.load_hf, tmp_path / "empty")
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text(json.dumps(config))
    assert "no weights" in user_error_line(hf.load_hf, tmp_path / "no_weights")
    for change, expected in [({"model_type": "falcon", "architectures": ["FalconForCausalLM"]}, "'falcon'"),
                             ({"model_type": "gemma3"}, "'gemma3'"),
                             ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
                             ({"mlp_bias": True}, "mlp_bias"),
                             ({"hidden_act": "tanh"}, "hidden_act")]:
        message = user_error_line(hf.hf_config_to_model_config, {**config, **change})
        assert expected in message


def test_unexpressible_window_layers_are_refused(root):
    _, path = _checkpoint("qwen3", root)
    config = _config(path)
    config.update(use_sliding_window=True, sliding_window=16, max_window_layers=1, layer_types=None)
    assert "windowed layers [1]" in user_error_line(hf.hf_config_to_model_config, config)
    config["max_window_layers"] = 0
    assert hf.hf_config_to_model_config(config).sliding_window == 16


def test_gemma_attention_softcap_is_refused(root):
    """transformers' Gemma3 attention ignores attn_logit_softcapping (Gemma 2's): no logits could agree."""
    _, path = _checkpoint("gemma3_text", root)
    config = _config(path)
    assert "attn_logit_softcapping" in user_error_line(hf.hf_config_to_model_config,
                                                      {**config, "attn_logit_softcapping": 50.0})


def test_multimodal_gemma3_directory_loads_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration directory (the Hub's Gemma 3 4B-27B): its text_config and language_model.*
    tensors load as Gemma 3 text, with the image-text model's logits on text (which it does not soft-cap, though its
    text_config here names a cap); a Hub-style text_config that lists only what differs from Gemma3TextConfig's
    defaults reads the same."""
    text = {**SIZES, **FAMILIES["gemma3_text"][2], "num_hidden_layers": 2, "tie_word_embeddings": False}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=95, boi_token_index=93, eoi_token_index=94,
                                       tie_word_embeddings=False)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    _redraw(model)
    model.save_pretrained(tmp_path / "gemma3")
    params, cfg = hf.load_hf(tmp_path / "gemma3")
    assert (cfg.n_layer, cfg.sliding_window, cfg.window_pattern, cfg.tie_embeddings) == (2, 48, 2, False)
    assert text["final_logit_softcapping"] == 15.0 and cfg.logit_softcap is None
    idx = np.random.default_rng(0).integers(0, 90, size=(1, 100))  # (no image tokens)
    np.testing.assert_allclose(jax_logits(params, cfg, idx), hf_logits(model, idx), rtol=0, atol=TOL)
    defaults = transformers.Gemma3TextConfig().to_dict()
    assert hf.MULTIMODAL["gemma3"][1] == {k: defaults[k] for k in hf.MULTIMODAL["gemma3"][1]}
    hub = _config(tmp_path / "gemma3")
    hub["text_config"] = {k: v for k, v in hub["text_config"].items() if k in ("hidden_size", "num_hidden_layers")}
    sparse = hf.text_model_config(hub, "config.json")
    assert hf.hf_config_to_model_config(sparse).n_embd == 32 and sparse["vocab_size"] == defaults["vocab_size"]


def test_transformers_4_keys_read_as_rope_parameters(root):
    _, path = _checkpoint("gemma3_text", root)
    config = _config(path)
    del config["rope_parameters"]
    config.update(rope_theta=100000.0, rope_local_base_freq=10000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert hf.hf_config_to_model_config(config) == hf.load_hf(path)[1]


def test_weights_source_loads_a_llama_directory(root):
    _, path = _checkpoint("llama", root)
    loaded = weights.load(f"hf:{path}")
    assert loaded.model.gated_mlp and loaded.tokenizer_meta is None and loaded.meta == {}
