"""`weights.require_same_run`, the one check every task makes before resuming a run's checkpoint, and
`weights.source_of`, the one way the commands turn their model flags into a weights source."""

from __future__ import annotations

import pytest

from jaxgpt.errors import UserError
from jaxgpt.io import weights
from jaxgpt.model.config import ModelConfig

CFG = ModelConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=16)


def test_the_same_run_resumes_and_a_setting_added_since_reads_as_its_default() -> None:
    saved = CFG.to_dict()
    del saved["qk_norm"]  # a run saved before the option existed computed what its default computes
    weights.require_same_run({"model": saved}, CFG, "runs/x", "use the same config", tokenizer=({"a": 1}, {"a": 1}))


def test_every_difference_is_named_in_one_line() -> None:
    with pytest.raises(UserError) as info:
        weights.require_same_run({"model": CFG.to_dict()}, CFG.replace(n_layer=3, block_size=64), "runs/x",
                                 "use the same config", tokenizer=({"type": "char"}, {"type": "bpe"}))
    assert str(info.value) == ("runs/x holds a run with other block_size, n_layer, tokenizer: use the same config, "
                               "or a new --config.workdir")


@pytest.mark.parametrize(("named", "source"), [
    (dict(workdir="runs/x"), "workdir:runs/x"),
    (dict(init_from="gguf:smollm2"), "gguf:smollm2"),
    (dict(init_from="workdir:runs/x"), "workdir:runs/x"),
    (dict(preset="gpt2"), "preset:gpt2"),
])
def test_a_model_named_one_way_is_one_source(named: dict, source: str) -> None:
    assert weights.source_of(**named) == source


@pytest.mark.parametrize("named", [{}, dict(workdir="runs/x", preset="gpt2")])
def test_a_model_named_no_way_or_two_ways_is_one_line(named: dict) -> None:
    with pytest.raises(UserError, match=r"^name the model with exactly one of workdir, init_from or preset \(got"):
        weights.source_of(**named)
