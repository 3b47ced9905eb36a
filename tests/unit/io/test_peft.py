"""PEFT files without torch (`jaxgpt.io.peft`): written and read back exactly, scanned layers too; GPT-2's fused
c_attn refused for q/k/v."""

from __future__ import annotations

import json
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest
from helpers.models import modern, shrink

from jaxgpt.errors import UserError
from jaxgpt.model import lora
from jaxgpt.model.gpt import abstract_variables
from jaxgpt.model.presets import get_preset

pytest.importorskip("safetensors")
from jaxgpt.io import peft

SETTINGS = {"rank": 4, "alpha": 8.0, "rslora": False}


def adapters_for(cfg, targets=()):
    found = lora.sites(abstract_variables(cfg)["params"], targets, 4)
    rng = np.random.default_rng(0)
    return found, jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32),
                               nn.unbox(lora.init_adapters(found, jax.random.key(0))))


@pytest.mark.parametrize("scan", [False, True])
def test_written_adapters_read_back_exactly(tmp_path: Path, scan: bool) -> None:
    cfg = modern("gqa").replace(gated_mlp=True, activation="silu", norm="rmsnorm", use_bias=False,
                                position="none", rope_theta=10000.0, scan_layers=scan)
    found, adapters = adapters_for(cfg)
    peft.write_peft(adapters, cfg, SETTINGS, tmp_path, "base")
    back = peft.read_peft(str(tmp_path), cfg, lora.LoRAConfig(rank=4, alpha=8.0), found)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)


def test_gpt2_c_attn_is_one_block_diagonal_lora_of_the_same_update(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    cfg = shrink(get_preset("gpt2"))
    _, adapters = adapters_for(cfg, ("q", "v", "o"))
    peft.write_peft(adapters, cfg, {**SETTINGS, "dropout": 0.05}, tmp_path, "gpt2")
    config = json.loads((tmp_path / peft.CONFIG_FILE).read_text())
    assert config["lora_dropout"] == 0.05  # config.lora.dropout, as PEFT names it
    assert config["rank_pattern"] == {"c_attn": 12} and config["alpha_pattern"] == {"c_attn": 24.0}
    assert config["fan_in_fan_out"]  # Conv1D
    tensors = load_file(tmp_path / peft.TENSORS_FILE)
    a = tensors["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"]
    b = tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"]
    assert a.shape == (12, 32) and b.shape == (96, 12)
    delta_IO = (b @ a).T * 2.0  # PEFT's update of the (in, out) Conv1D weight, scale alpha / r = 24 / 12
    zero = {"h_0": {"attn": {"qkv": {"kernel": np.zeros((32, 3, 4, 8), np.float32)}}}}
    qkv = {"h_0": {"attn": {"qkv": adapters["h_0"]["attn"]["qkv"]}}}
    expected = lora.merge(zero, qkv, 2.0)["h_0"]["attn"]["qkv"]["kernel"]
    np.testing.assert_allclose(delta_IO, np.asarray(expected).reshape(32, 96), atol=1e-5)
    with pytest.raises(UserError, match="rank_pattern") as e:  # such a file is not read back
        peft.read_peft(str(tmp_path), cfg, lora.LoRAConfig(rank=4, alpha=8.0, targets="q,v,o"),
                       lora.sites(abstract_variables(cfg)["params"], ("q", "v", "o"), 4))
    assert "\n" not in str(e.value)
