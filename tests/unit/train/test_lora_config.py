"""config.lora's checks (`jaxgpt.model.lora.LoRAConfig`, `TrainConfig`): bad settings are one-line errors."""

from __future__ import annotations

import pytest

from jaxgpt.errors import UserError
from jaxgpt.train.config import base_config, from_config_dict


@pytest.mark.parametrize(("changes", "message"), [
    ({"lora.rank": 0, "lora.targets": "q,v"}, "rank=0"),
    ({"lora.rank": -1}, ">= 0"),
    ({"lora.rank": 8, "lora.targets": "q,attn"}, "attn"),
    ({"lora.rank": 8, "lora.init_from": "DIR"}, "peft:DIR"),
    ({"lora.rank": 8}, "init_from"),  # no base to adapt
    ({"lora.rank": 8, "lora.dropout": 1.0}, "dropout"),
    ({"lora.rank": 8, "lora.quantize": "int4"}, "int8, nf4"),
    ({"lora.rank": 8, "lora.quantize": "nf4", "lora.quantize_group": 63}, "even"),
    ({"lora.quantize": "nf4"}, "rank=0"),
    ({"lora.modules_to_save": "wte"}, "modules_to_save are set but config.lora.rank=0"),
    ({"lora.rank": 8, "task": "classify", "init_from": "hf:x"}, "task lm, chat, rl or dpo"),
])
def test_bad_lora_settings_are_one_line_errors(changes: dict, message: str) -> None:
    c = base_config()
    c.workdir = "runs/x"
    for key, value in changes.items():
        node = c
        *parents, name = key.split(".")
        for parent in parents:
            node = node[parent]
        node[name] = value
    with pytest.raises(UserError, match=message) as e:
        from_config_dict(c)
    assert "\n" not in str(e.value)


def test_lora_settings_are_typed() -> None:
    c = base_config()
    c.workdir, c.init_from, c.lora.rank, c.lora.targets = "runs/x", "hf:x", 8, "q, v"
    cfg = from_config_dict(c)
    assert cfg.lora.target_names == ("q", "v") and cfg.lora.alpha == 16.0 and not cfg.lora.rslora
    assert cfg.lora.dropout == 0.0  # PEFT's LoraConfig default
