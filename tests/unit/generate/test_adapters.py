"""Several LoRA adapters in one continuous batch (`jaxgpt.generate.adapters`): the stack pads ranks and folds the
scales in exactly, and rows of different adapters and of the base, decoding in the same chunks, each give the
tokens of its adapter's merged model alone (greedy), on a fused-q/k/v GPT-2 and on a scanned model with grouped
query attention, a gated MLP and an untied head."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.adapters import random_adapters
from helpers.models import modern, random_params
from helpers.server import CFG

from jaxgpt.errors import UserError
from jaxgpt.generate import sampling
from jaxgpt.generate.adapters import Adapter, one_hot, stack
from jaxgpt.generate.engine import Engine, Request
from jaxgpt.model import lora
from jaxgpt.model.config import ModelConfig


def test_the_stack_pads_ranks_folds_scales_and_zeros_what_an_adapter_leaves_out() -> None:
    small, big = random_adapters(CFG, "q,v", 2, seed=1), random_adapters(CFG, "v,down", 5, seed=2)
    stacked = stack([Adapter("small", small, 4.0), Adapter("big", big, 0.5)], CFG)
    v = stacked.tree["h_1"]["attn"]["qkv"]["v"]
    assert v["lora_a"].shape == (2, CFG.n_embd, 5) and v["lora_b"].shape[:2] == (2, 5)
    small_v = small["h_1"]["attn"]["qkv"]["v"]
    np.testing.assert_array_equal(v["lora_a"][0, :, :2], small_v["lora_a"])
    np.testing.assert_array_equal(v["lora_b"][0, :2], 4.0 * small_v["lora_b"])
    assert not v["lora_a"][0, :, 2:].any() and not v["lora_b"][0, 2:].any()  # the padding: exact zeros
    np.testing.assert_array_equal(v["lora_b"][1], 0.5 * big["h_1"]["attn"]["qkv"]["v"]["lora_b"])
    q, down = stacked.tree["h_0"]["attn"]["qkv"]["q"], stacked.tree["h_0"]["mlp"]["proj"]["down"]
    assert not q["lora_b"][1].any() and not down["lora_b"][0].any()  # each leaves the other's target out
    np.testing.assert_array_equal(one_hot(stacked, "big"), [0, 1])
    np.testing.assert_array_equal(one_hot(stacked, None), [0, 0])
    assert one_hot(None, None) is None
    with pytest.raises(UserError, match="no adapter named 'other'"):
        one_hot(stacked, "other")


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
                Adapter("c", random_adapters(cfg, "o,down", 4, seed=3), 1.0)]
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
