"""PEFT files without torch (`jaxgpt.io.peft`): written and read back exactly, scanned layers too; GPT-2's fused
c_attn refused for q/k/v."""

from __future__ import annotations

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


def test_gpt2_q_k_v_are_refused_and_the_rest_exports(tmp_path: Path) -> None:
    cfg = shrink(get_preset("gpt2"))
    with pytest.raises(UserError, match="c_attn") as e:
        peft.write_peft(adapters_for(cfg)[1], cfg, SETTINGS, tmp_path / "all", "gpt2")
    assert "\n" not in str(e.value)
    peft.write_peft(adapters_for(cfg, ("o", "up", "down"))[1], cfg, SETTINGS, tmp_path / "some", "gpt2")
    assert (tmp_path / "some" / peft.TENSORS_FILE).is_file()
