"""Every shipped config loads, resolves to valid typed configs, and builds its model abstractly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxgpt.model import GPT
from jaxgpt.train_config import from_config_dict

CONFIGS = sorted(p for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.py")
                 if not p.stem.startswith("classify_"))  # classification configs: tests/test_classify.py


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_resolves_and_builds(path: Path) -> None:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    cfg = from_config_dict(c)
    if cfg.vocab_from_data:
        cfg = cfg.with_model(cfg.model.replace(vocab_size=50257 if c.data.name in ("shakespeare", "openwebtext")
                                               else 100))
    assert cfg.workdir and cfg.optim.decay_steps >= cfg.optim.warmup_steps
    idx = jnp.zeros((1, 4), jnp.int32)
    shapes = jax.eval_shape(GPT(cfg.model).init, jax.random.key(0), idx)
    assert shapes["params"]
