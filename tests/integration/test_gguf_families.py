"""Qwen2, Qwen3 and Gemma 3 GGUF files against transformers: a tiny random model of each family (its config class,
`save_pretrained`, float32) written as GGUF the way llama.cpp's converter writes it (gguf-py's own tensor-name
table, its metadata keys, Gemma's norms stored as 1 + w, no q/k permutation), read by `gguf:` and compared with
transformers' logits from the safetensors directory and from transformers' own GGUF loader (`gguf_file=`).
Removing a family's quirk on the GGUF side (Gemma's norm shift, Qwen's unpermuted rows) breaks the agreement."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
pytestmark = pytest.mark.torch

from test_hf_llama import _redraw, hf_logits, jax_logits  # noqa: E402

from jaxgpt.io import gguf as jaxgpt_gguf  # noqa: E402
from jaxgpt.io.gguf import GGUFFile, load_gguf  # noqa: E402

TOL = 1e-4
LENGTH = 520  # past every window
SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=640, bos_token_id=None, eos_token_id=None,
             pad_token_id=None, rms_norm_eps=1e-5)
# family -> (config class, model class, GGUF architecture, config). Gemma 3 keeps what GGUF cannot store at the
# values llama.cpp assumes: every 6th layer global, a local base of 10000, query_pre_attn_scalar = head_dim (256,
# also transformers' default, so its GGUF loader agrees).
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", dict(tie_word_embeddings=True, rope_theta=5000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", dict(head_dim=8, rope_theta=20000.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3", dict(
        num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=48, final_logit_softcapping=None,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


def write_like_llama_cpp(path, arch: str, hf: dict, tensors: dict[str, np.ndarray]) -> None:
    """A GGUF file as llama.cpp's convert_hf_to_gguf.py writes this family (float32 tensors)."""
    n_layer = hf["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layer)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    if hf.get("head_dim"):  # (the converter writes it when config.json has it)
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_vocab_size(hf["vocab_size"])
    if arch == "gemma3":
        w.add_rope_freq_base(hf["rope_parameters"]["full_attention"]["rope_theta"])
        w.add_sliding_window(hf["sliding_window"])
    else:
        w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    for name, array in tensors.items():
        stored = array + 1 if arch == "gemma3" and name.endswith("norm.weight") else array
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), stored.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@functools.cache
def _family(family: str, root: str) -> tuple[object, str]:
    """(transformers model, the GGUF file of its weights), made once per session."""
    config_class, model_class, arch, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SIZES, **extra})
    model = getattr(transformers, model_class)(config).eval()
    _redraw(model)
    if arch == "gemma3":  # norm weights on a grid where w + 1 is exact in float32 (the file's rounding is not the
        # loader's); q/k norms of 1 + w ~ 0.4: sharper scores over 256-dimensional heads drift past 1e-4 in float32
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.normal_(-0.6, 0.05)
                if name.endswith("norm.weight"):
                    p.copy_(torch.round(p * 4096) / 4096)
    model.save_pretrained(f"{root}/{family}")
    tensors = safetensors_numpy.load_file(f"{root}/{family}/model.safetensors")
    path = f"{root}/{family}.gguf"
    write_like_llama_cpp(path, arch, model.config.to_dict(), tensors)
    return model, path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("gguf_families"))


def ids(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, SIZES["vocab_size"], size=(1, LENGTH))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(root, family):
    model, path = _family(family, root)
    params, cfg = load_gguf(GGUFFile(path))
    idx = ids()
    theirs = hf_logits(model, idx)
    assert np.abs(theirs).max() > 1.0
    np.testing.assert_allclose(jax_logits(params, cfg, idx), theirs, rtol=0, atol=TOL)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_logits_match_transformers_gguf_loader(root, family):
    """transformers reads the same file (`gguf_file=`) to the same logits. (Not Qwen3: transformers' GGUF loader
    ignores qwen3.attention.key_length and builds heads of its default 128 dimensions.)"""
    _, path = _family(family, root)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(root, gguf_file=path.rsplit("/", 1)[1],
                                                               torch_dtype=torch.float32).eval()
    params, cfg = load_gguf(GGUFFile(path))
    idx = ids(seed=2)
    np.testing.assert_allclose(jax_logits(params, cfg, idx), hf_logits(theirs, idx), rtol=0, atol=TOL)


def test_gemma3_config_read_as_llama_cpp_assumes(root):
    _, path = _family("gemma3", root)
    cfg = load_gguf(GGUFFile(path))[1]
    assert (cfg.sliding_window, cfg.window_pattern, cfg.rope_local_theta, cfg.rope_theta) == (48, 6, 1e4, 1e5)
    assert (cfg.norm_scale_offset, cfg.sandwich_norm, cfg.scale_embeddings, cfg.qk_norm) == (1.0, True, True, True)
    assert cfg.query_scale == pytest.approx(256 ** -0.5)


# Each family's GGUF quirk removed: Gemma's stored 1 + w read as w, Qwen's rows un-permuted as Llama's are.
QUIRKS = {"qwen2": dict(interleaved_qk=True), "qwen3": dict(interleaved_qk=True), "gemma3": dict(norm_shift=0.0)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_quirk_matters(root, family, monkeypatch):
    model, path = _family(family, root)
    arch = FAMILIES[family][2]
    monkeypatch.setitem(jaxgpt_gguf.ARCHITECTURES, arch,
                        dataclasses.replace(jaxgpt_gguf.ARCHITECTURES[arch], **QUIRKS[family]))
    params, cfg = load_gguf(GGUFFile(path))
    idx = ids()
    assert np.abs(jax_logits(params, cfg, idx) - hf_logits(model, idx)).max() > 100 * TOL
