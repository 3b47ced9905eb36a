"""`save_gguf` of Qwen2, Qwen3, Gemma 3 and a llama3-scaled Llama: tiny random transformers models (float32), loaded
from their directories, written as GGUF and read back by `gguf:` to transformers' logits (and by transformers' own
GGUF loader where it reads the architecture); what GGUF cannot hold is one line."""

from __future__ import annotations

import functools

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.torch

from helpers import user_error_line  # noqa: E402
from test_gguf_families import _family, ids  # noqa: E402
from test_hf_llama import SIZES, _checkpoint, _redraw, hf_logits, jax_logits  # noqa: E402

from jaxgpt.io.gguf import GGUFFile, load_gguf  # noqa: E402
from jaxgpt.io.gguf_export import ROPE_FREQS, save_gguf  # noqa: E402
from jaxgpt.io.hf import load_hf  # noqa: E402
from jaxgpt.model.layers import rope_frequencies  # noqa: E402

TOL = 1e-4
# llama3 scaling whose table blends three frequencies (head_dim 16: wavelengths 20, 63 and 199 lie between
# original / high_freq_factor = 16 and original / low_freq_factor = 256)
LLAMA3 = dict(num_attention_heads=2, head_dim=16, rope_parameters={
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 16.0,
    "original_max_position_embeddings": 256})


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("gguf_export_families"))


@functools.cache
def _llama3(root: str) -> tuple[object, str]:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SIZES, **LLAMA3})).eval()
    _redraw(model)
    model.save_pretrained(f"{root}/llama3")
    return model, f"{root}/llama3"


def _export(directory: str, path: str):
    params, cfg = load_hf(directory)
    save_gguf(params, cfg, path)
    return cfg, load_gguf(GGUFFile(path))


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_families_round_trip_to_transformers_logits(root, family):
    model, _ = _family(family, root)
    path = f"{root}/{family}-export.gguf"
    cfg, (params, back) = _export(f"{root}/{family}", path)
    assert back.replace(norm_eps=cfg.norm_eps) == cfg and back.norm_eps == pytest.approx(cfg.norm_eps)  # (float32)
    assert GGUFFile(path).get("general.architecture") == family
    idx = ids()
    np.testing.assert_allclose(jax_logits(params, back, idx), hf_logits(model, idx), rtol=0, atol=TOL)
    if family != "qwen3":  # (transformers' GGUF loader ignores qwen3's key_length: test_gguf_families)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(root, gguf_file=path.rsplit("/", 1)[1],
                                                                   dtype=torch.float32).eval()
        np.testing.assert_allclose(hf_logits(theirs, idx), hf_logits(model, idx), rtol=0, atol=TOL)


def test_yarn_scaling_travels_as_keys(root):
    """Qwen3 with yarn (test_hf_llama's): rope.scaling.type, factor and original context length."""
    model, directory = _checkpoint("qwen3", root)
    cfg, (params, back) = _export(directory, f"{root}/yarn.gguf")
    assert back.replace(norm_eps=cfg.norm_eps) == cfg and back.rope_scaling == "yarn"
    idx = ids()
    np.testing.assert_allclose(jax_logits(params, back, idx), hf_logits(model, idx), rtol=0, atol=TOL)


def test_llama3_scaling_travels_as_llama_cpp_rope_freqs_table(root):
    model, directory = _llama3(root)
    path = f"{root}/llama3.gguf"
    cfg, (params, back) = _export(directory, path)
    table = GGUFFile(path).dequantize(ROPE_FREQS)
    assert table.min() == 1.0 and table.max() == 8.0 and np.sum((table > 1) & (table < 8)) == 3
    assert back.rope_scaling == "llama3" and back.rope_factor == 8.0
    np.testing.assert_allclose(rope_frequencies(back, False)[0], rope_frequencies(cfg, False)[0], rtol=1e-6)
    idx = ids()
    np.testing.assert_allclose(jax_logits(params, back, idx), hf_logits(model, idx), rtol=0, atol=TOL)
    unscaled = back.replace(rope_scaling=None)
    assert np.abs(jax_logits(params, unscaled, idx) - hf_logits(model, idx)).max() > 100 * TOL


def test_what_gguf_cannot_hold_is_one_line(root, tmp_path):
    params, cfg = load_hf(_llama3(root)[1])
    out = str(tmp_path / "m.gguf")
    assert "activation" in user_error_line(save_gguf, params, cfg.replace(activation="gelu"), out)
    mistral = cfg.replace(rope_scaling=None, sliding_window=64)
    assert "Mistral" in user_error_line(save_gguf, params, mistral, out)
    own_yarn = cfg.replace(rope_scaling="yarn", rope_attention_factor=1.5)  # (not the default 0.1 ln 8 + 1)
    assert "yarn" in user_error_line(save_gguf, params, own_yarn, out)
