"""Several LoRA adapters in one continuous batch (`jaxgpt.generate.adapters`): the stack packs ranks side by side
and folds the scales in exactly, and rows of different adapters and of the base, decoding in the same chunks, each
give the tokens of its adapter's merged model alone (greedy), on a fused-q/k/v GPT-2 and on a scanned model with
grouped query attention, a gated MLP and an untied head."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.adapters import random_adapters
from helpers.models import modern, random_params
from helpers.server import CFG

from jaxgpt.errors import UserError
from jaxgpt.generate import sampling
from jaxgpt.generate.adapters import Adapter, columns_of, stack
from jaxgpt.generate.engine import Engine, Request
from jaxgpt.model import lora
from jaxgpt.model.config import ModelConfig


def test_the_stack_packs_ranks_side_by_side_folds_scales_and_zeros_what_an_adapter_leaves_out() -> None:
    small, big = random_adapters(CFG, "q,v", 2, seed=1), random_adapters(CFG, "v,down", 5, seed=2)
    mixed = lora.overlay(random_adapters(CFG, "q", 1, seed=3), random_adapters(CFG, "down", 3, seed=4))  # 2 ranks
    stacked = stack([Adapter("small", small, 4.0), Adapter("big", big, 0.5), Adapter("mixed", mixed, 1.0)], CFG)
    assert stacked.starts == (0, 2, 7, 10) and stacked.width == 10  # each as wide as its largest rank: no padding
    v, q = stacked.tree["h_1"]["attn"]["qkv"]["v"], stacked.tree["h_1"]["attn"]["qkv"]["q"]
    assert v["lora_a"].shape == (CFG.n_embd, 10) and v["lora_b"].shape[0] == 10
    small_v, big_v = small["h_1"]["attn"]["qkv"]["v"], big["h_1"]["attn"]["qkv"]["v"]
    np.testing.assert_array_equal(v["lora_a"][:, :2], small_v["lora_a"])
    np.testing.assert_array_equal(v["lora_b"][:2], 4.0 * small_v["lora_b"])
    np.testing.assert_array_equal(v["lora_a"][:, 2:7], big_v["lora_a"])
    np.testing.assert_array_equal(v["lora_b"][2:7], 0.5 * big_v["lora_b"])
    assert not v["lora_a"][:, 7:].any() and not v["lora_b"][7:].any()  # mixed leaves v out: zeros, exactly
    np.testing.assert_array_equal(q["lora_a"][:, 7], mixed["h_1"]["attn"]["qkv"]["q"]["lora_a"][:, 0])
    assert not q["lora_a"][:, 8:].any() and not q["lora_b"][8:].any()  # its q's rank 1 of its 3 columns
    assert not q["lora_b"][2:7].any() and not stacked.tree["h_0"]["mlp"]["proj"]["down"]["lora_b"][:2].any()
    np.testing.assert_array_equal(columns_of(stacked, "big"), [0, 0, 1, 1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(columns_of(stacked, None), np.zeros(10))
    assert columns_of(None, None) is None
    with pytest.raises(UserError, match="no adapter named 'other'"):
        columns_of(stacked, "other")


def scanned_modern() -> tuple[ModelConfig, str]:
    cfg = modern("nanochat-gqa-scan-xla")
    assert cfg.scan_layers and cfg.n_kv_head < cfg.n_head
    return cfg.replace(gated_mlp=True), "q,k,v,o,gate,up,down" + (",head" if not cfg.tie_embeddings else "")


@pytest.mark.parametrize("model", ["gpt2-fused-qkv", "scanned-gqa-gated"])
def test_rows_of_every_adapter_and_the_base_share_chunks_and_each_equals_its_merged_model(model: str) -> None:
    cfg, every = (CFG, "q,k,v,o,up,down") if model == "gpt2-fused-qkv" else scanned_modern()
    base = random_params(cfg)
    adapters = [Adapter("a", random_adapters(cfg, "q,v", 1, seed=1), 2.0),
                Adapter("b", random_adapters(cfg, every, 3, seed=2), 0.5),
                Adapter("c", lora.overlay(random_adapters(cfg, "o", 4, seed=3),
                                          random_adapters(cfg, "down", 2, seed=4)), 1.0)]  # down: 2 of its 4 columns
    engine = Engine(base, cfg, slots=8, chunk=3, adapters=stack(adapters, cfg))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, int(n)).tolist() for n in rng.integers(2, 8, 8)]
    names = [None, "a", "b", "c", "c", None, "a", "b"]
    got: list[list[int]] = [[] for _ in prompts]
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        engine.submit(Request(prompt, 6, emit=lambda t, *_, i=i: got[i].append(t), done=lambda _: None,
                              temperature=0.0, adapter=name))
    engine.drain()
    merged = {a.name: lora.merge(base, a.tree, a.scale) for a in adapters}
    for prompt, name, tokens in zip(prompts, names, got, strict=True):
        params = base if name is None else merged[name]
        want = sampling.generate(params, cfg, prompt, max_new_tokens=6, temperature=0.0)[0].tolist()
        assert tokens == want, name
    alone = [sampling.generate(base, cfg, p, max_new_tokens=6, temperature=0.0)[0].tolist() for p in prompts]
    changed = {name for name, g, a in zip(names, got, alone, strict=True) if g != a}
    assert changed == {"a", "b", "c"}  # every adapter changes what its rows say; the base's rows are the base's
