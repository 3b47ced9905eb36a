"""Mesh shapes, their one-line errors and the rules table (sharded training runs on fake devices:
tests/integration/test_sharding_runs.py)."""

from __future__ import annotations

import pytest
from jax.sharding import AbstractMesh

from jaxgpt.errors import UserError
from jaxgpt.train import sharding as layout

pytestmark = pytest.mark.jax_release






















def test_mesh_shape_resolution_and_errors() -> None:
    assert layout.resolve_mesh_shape((-1, 2, 2), 8) == (2, 2, 2)
    assert layout.resolve_mesh_shape((1, -1, 1), 8) == (1, 8, 1)
    for bad in [(3, -1, 1), (2, 2, 1), (-1, -1, 1), (0, 8, 1)]:
        with pytest.raises(UserError):
            layout.resolve_mesh_shape(bad, 8)


def test_divisibility_errors_name_the_fix() -> None:
    from jaxgpt.model.config import ModelConfig

    mesh = AbstractMesh((2, 2, 2), layout.MESH_AXES)
    layout.check_divisibility(layout.model_sizes(ModelConfig(n_head=4, n_embd=32)), mesh, global_batch=8)
    with pytest.raises(UserError, match="n_head=3 over tensor=2"):
        layout.check_divisibility(layout.model_sizes(ModelConfig(n_head=3, n_embd=48)), mesh, global_batch=8)
    with pytest.raises(UserError, match="micro-batch batch_size/grad_accum = 2 over data\\*fsdp=4"):
        layout.check_divisibility(layout.model_sizes(ModelConfig(n_head=4, n_embd=32)), mesh, global_batch=8,
                                  grad_accum=4)


def test_vocab_rule_replicates_an_indivisible_vocabulary() -> None:
    from jaxgpt.model.config import ModelConfig

    mesh = AbstractMesh((1, 1, 4), layout.MESH_AXES)
    assert dict(layout.rules_for(layout.model_sizes(ModelConfig(vocab_size=50304)), mesh))["vocab"] == "tensor"
    assert dict(layout.rules_for(layout.model_sizes(ModelConfig(vocab_size=50257)), mesh))["vocab"] is None
