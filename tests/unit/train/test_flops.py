"""The FLOP count behind MFU: weights counted from the parameter tree, attention from the keys each query sees."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from helpers.models import modern

from jaxgpt.model.gpt import abstract_variables
from jaxgpt.train.flops import flops_per_token, matmul_params


@pytest.mark.parametrize("name", ["swiglu", "gqa", "gemma3-like"])
def test_matmul_params_are_the_projection_kernels_of_the_tree(name: str) -> None:
    """Every kernel of a projection (2-D or more; an untied head included, a tied table counted once as the head)."""
    cfg = modern(name)
    params = nn.unbox(abstract_variables(cfg)["params"])
    kernels = sum(int(np.prod(leaf.shape)) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                  if getattr(path[-1], "key", None) == "kernel")
    head = 0 if "lm_head" in params else cfg.vocab_size * cfg.n_embd
    assert matmul_params(cfg) == kernels + head


def test_windowed_layers_count_the_keys_their_queries_see() -> None:
    """Attention FLOPs per token: a causal layer's queries see (i + 1) keys, about T/2 on average; a windowed
    layer's min(i + 1, W), counted here by brute force over the row."""
    cfg = modern("gemma3-like")
    T, W, H, D = cfg.block_size, cfg.sliding_window, cfg.n_head, cfg.head_dim
    keys = sum(np.mean(np.minimum(np.arange(T) + 1, W)) if windowed else T / 2
               for windowed in cfg.windowed_layers())
    assert any(cfg.windowed_layers()) and not all(cfg.windowed_layers()) and W < T
    want = 6 * matmul_params(cfg) + 12 * keys * H * D
    assert flops_per_token(cfg) == pytest.approx(want)
    unwindowed = cfg.replace(sliding_window=None, window_pattern=None, rope_local_theta=None)
    assert flops_per_token(unwindowed) > flops_per_token(cfg)
