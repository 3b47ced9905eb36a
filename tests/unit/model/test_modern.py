"""The 2026 options (issue 37) on a device mesh: a grouped-query, rotary model shards like GPT-2.

The numpy reference checks (tests/unit/model/test_model.py) and the decoding checks
(tests/unit/generate/test_sampling.py) run on one device; here eight fake CPU devices (XLA_FLAGS before jax is
imported: a subprocess) check that the new parameters carry logical axis names the rules table maps, and that a
sharded loss and its gradients equal the single-device ones; and `jaxgpt aot` plans nanochat's architecture for a
TPU slice.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import ROOT
from jax.sharding import AbstractMesh

from jaxgpt.model.config import ModelConfig
from jaxgpt.model.presets import get_preset
from jaxgpt.train import sharding as layout

WORKER = """
import jax, jax.numpy as jnp, numpy as np
import flax.linen as nn
from jaxgpt.model.gpt import GPT, abstract_variables, init_params
from jaxgpt.model.presets import get_preset
from jaxgpt.train import sharding as layout

cfg = get_preset("nanochat-d12").replace(vocab_size=64, block_size=16, n_layer=1, n_embd=32, n_head=4, n_kv_head=2,
                                         norm_scale=True, zero_init_proj=False)
params = init_params(cfg, jax.random.key(0))
idx = jax.random.randint(jax.random.key(1), (8, 17), 0, cfg.vocab_size)

def loss(p, idx):
    logits = GPT(cfg).apply({"params": p}, idx[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), idx[:, 1:, None], -1))

want_l, want_g = jax.jit(jax.value_and_grad(loss))(params, idx)
specs = nn.get_partition_spec(abstract_variables(cfg)["params"])
assert specs["h_0"]["attn"]["kv"]["kernel"] == jax.sharding.PartitionSpec("embed", None, "kv_heads", "head_dim")
for shape in ((2, 2, 2), (1, 2, 4)):
    mesh = layout.make_mesh(shape)
    rules = layout.rules_for(layout.model_sizes(cfg), mesh)
    sh = layout.logical_to_sharding(specs, mesh, rules)
    with layout.activate(mesh, rules):
        step = jax.jit(jax.value_and_grad(loss), in_shardings=(sh, layout.batch_sharding(mesh)),
                       out_shardings=(layout.replicated(mesh), sh))
        got_l, got_g = step(jax.device_put(params, sh), jax.device_put(idx, layout.batch_sharding(mesh)))
    kv = tuple(got_g["h_0"]["attn"]["kv"]["kernel"].sharding.spec)
    assert abs(float(got_l) - float(want_l)) < 1e-5, (shape, got_l, want_l)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), got_g, want_g)
    print("MESH", shape, "kv", kv, "loss", float(got_l))
"""


@pytest.mark.slow
def test_grouped_query_rotary_model_shards_like_one_device() -> None:
    """Meshes (2, 2, 2) and (1, 2, 4): with tensor = 4 the two key/value heads are replicated (rules_for).
    Slow: a subprocess importing JAX on eight devices and compiling three programs (about 40 s of CPU)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(["timeout", "300", sys.executable, "-c", WORKER], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=330)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MESH")]
    assert len(lines) == 2
    assert "kv ('fsdp', None, 'tensor', None)" in lines[0] and "kv ('fsdp', None, None, None)" in lines[1]


def test_kv_heads_rule_replicates_heads_the_tensor_axis_does_not_divide() -> None:
    mesh = AbstractMesh((1, 1, 4), layout.MESH_AXES)
    rules = lambda **kw: dict(layout.rules_for(layout.model_sizes(ModelConfig(n_head=8, n_embd=64, **kw)), mesh))
    assert rules(n_kv_head=4)["kv_heads"] == "tensor" and rules(n_kv_head=2)["kv_heads"] is None
    assert rules(n_kv_head=1)["heads"] == "tensor"  # the query heads still split


def _plan(topology: str, batch_size: int, **sizes: object) -> dict:
    """`jaxgpt aot`'s report for nanochat-d12 (`sizes` changed) trained on `topology`, data parallel."""
    from jaxgpt.tools import aot
    from jaxgpt.train.config import base_config, from_config_dict

    c = base_config()
    c.workdir, c.batch_size, c.mesh.data = "aot", batch_size, -1
    cfg = from_config_dict(c).with_model(get_preset("nanochat-d12").replace(dtype="bfloat16", **sizes))
    return aot.analyze(cfg, topology, extrapolate_scan=False)


needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")


@pytest.mark.slow
@needs_libtpu
def test_aot_plans_a_small_nanochat_with_grouped_queries_for_a_v5e_slice() -> None:
    r = _plan("v5e:2x2", 8, vocab_size=512, block_size=256, n_layer=2, n_embd=128, n_head=2, n_kv_head=1)
    assert r["fits"] and r["n_params"] > 0 and r["step_time"] > 0


@pytest.mark.slow
@needs_libtpu
def test_aot_plans_nanochat_d12_for_a_v5e_slice() -> None:
    r = _plan("v5e:2x2", 32)
    assert r["fits"] and 0.5 < r["flops_ratio"] < 1.5, (r["flops_ratio"], r["notes"])


@pytest.mark.slow
@needs_libtpu
def test_aot_plans_a_gemma3_like_model_for_a_v5e_slice() -> None:
    """Gemma 3's knobs (issue 62) plan for a TPU slice: windowed and global layers in one scan with their own
    rotary bases, (1 + w) sandwich norms and QK-norm before the rotary, soft-capped scores (`auto` takes the einsum
    path for them), qkv biases: every new parameter has logical axes the rules table maps."""
    r = _plan("v5e:2x2", 8, vocab_size=512, block_size=256, n_layer=2, n_embd=128, n_head=2, n_kv_head=1,
              scan_layers=True, norm_scale=True, norm_scale_offset=1.0, sandwich_norm=True, qk_norm_site="before_rope",
              gated_mlp=True, activation="gelu_tanh", qkv_bias=True, query_scale=0.1, attn_softcap=50.0,
              sliding_window=64, window_pattern=2, rope_local_theta=1e4, rope_scaling="linear", rope_factor=8.0,
              scale_embeddings=True, attention_impl="auto")
    assert r["fits"] and r["n_params"] > 0 and r["step_time"] > 0
