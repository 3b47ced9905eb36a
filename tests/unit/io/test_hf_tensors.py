"""`hf_tensors.qkv_places`: the one statement of where q, k and v sit in a block's attention, checked against the
parameters the model itself declares, and used by every family's tensor list; a multimodal checkpoint's language
model tensors under their *ForCausalLM names."""

from __future__ import annotations

import flax.linen as nn
import numpy as np
import pytest

from jaxgpt.io import hf_llama, hf_nanochat, hf_tensors
from jaxgpt.io.hf import language_model_tensors
from jaxgpt.io.hf_tensors import qkv_places
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import abstract_variables

BASE = ModelConfig(vocab_size=61, block_size=16, n_layer=1, n_head=4, n_embd=32, head_dim=8, position="none",
                   rope_theta=100.0, norm="rmsnorm", use_bias=False, gated_mlp=True, activation="silu")


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_places_are_the_models_own_kernels(n_kv_head):
    """Each place names a kernel the model declares, whose slot (or whole) is (C, heads, D)."""
    cfg = BASE.replace(n_kv_head=n_kv_head)
    attn = abstract_variables(cfg)["params"]["h_0"]["attn"]
    places = qkv_places(cfg)
    assert set(attn) >= {place.kernel for place in places.values()}
    for name, (kernel, slot, heads) in places.items():
        shape = nn.unbox(attn[kernel]["kernel"]).shape
        assert heads == (cfg.n_head if name == "q" else n_kv_head)
        part = shape if slot is None else shape[:1] + shape[2:]
        assert part == (cfg.n_embd, heads, cfg.head_dim), name
        if slot is not None:
            assert slot < shape[1]
    assert len({(p.kernel, p.slot) for p in places.values()}) == 3  # three distinct homes


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_families_put_projections_at_the_places(n_kv_head):
    """The Llama family's and NanoChat's q_proj, k_proj, v_proj specs fill exactly the places."""
    cfg = BASE.replace(n_kv_head=n_kv_head)
    places = qkv_places(cfg)
    llama = hf_llama.tensor_specs(hf_llama.QWEN2)(cfg.replace(qkv_bias=True))
    nano = hf_nanochat.tensor_specs(cfg)
    for specs in (llama, nano):
        for name, place in places.items():
            for spec in [s for s in specs if f".{name}_proj." in s.hf_name]:
                assert spec.path[1:3] == ("attn", place.kernel)
                assert spec.part == place.slot


def test_language_model_tensors_take_their_causal_lm_names_from_either_layout():
    """The Hub's (and transformers 5's) `language_model.model.*` and transformers 4.5x's `model.language_model.*`
    become `model.*`, `language_model.lm_head` `lm_head`; the image tower's names stay, read from their own file."""
    names = {"language_model.model.norm.weight": "a", "model.language_model.embed_tokens.weight": "b",
             "language_model.lm_head.weight": "a", "vision_tower.x.weight": "b"}
    reader = hf_tensors.TensorReader(names, lambda file, name: np.array([file, name]))
    renamed = language_model_tensors(reader)
    assert set(renamed) == {"model.norm.weight", "model.embed_tokens.weight", "lm_head.weight", "vision_tower.x.weight"}
    assert renamed.get("model.embed_tokens.weight").tolist() == ["b", "model.language_model.embed_tokens.weight"]
