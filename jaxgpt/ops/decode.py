"""The weights as the sampler's decode loop reads them: cast to the decoding dtype, and laid out for one row.

Batch-1 decoding reads every weight once per token, so their layout decides its speed on a CPU
(`output_major_for`, `jaxgpt.ops.projection`). The sampler asks here for the weights and for the kernel
storage the model then declares (`kernel_storage`); the model itself has no decoding-only code. The
prepared copy is kept while the caller holds the weights it came from, so generating again from the same
weights does not copy them again.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import abstract_variables
from jaxgpt.ops.platform import current_platform
from jaxgpt.ops.projection import DECLARED, OUTPUT_MAJOR


def output_major_for(batch: int) -> bool:
    """Whether the decode loop reads output-major kernels (`output_major_kernels`): batch 1 on CPUs.

    XLA:CPU's one-row product streams them faster; from a few rows on, its matrix products prefer the
    declared order (benchmarks/bench_sample.py prints both). Accelerators choose their own layouts.
    """
    return batch == 1 and current_platform() == "cpu"


def kernel_storage(output_major: bool) -> str:
    """The storage the model declares its kernels in (`EinsumDense.kernel_storage`) for `decoding_weights`'s
    weights."""
    return OUTPUT_MAJOR if output_major else DECLARED


@functools.cache
def _kernel_shapes(cfg: ModelConfig) -> dict[tuple, tuple[int, ...]]:
    """Each projection kernel's path -> its shape as a matrix: ([layers,] inputs, outputs).

    Kernels keep a stacked-layers axis first, then their input axes, then their output axes, which are
    the bias's axes: a model with biases tells each kernel's split, whatever `use_bias` says.
    """
    boxed = abstract_variables(cfg.replace(use_bias=True))["params"]
    flat = dict(jax.tree_util.tree_leaves_with_path(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)))
    shapes = {}
    for path, kernel in flat.items():
        bias = flat.get((*path[:-1], jax.tree_util.DictKey("bias")))
        if path[-1] == jax.tree_util.DictKey("kernel") and bias is not None:
            shape, lead = kernel.value.shape, int(kernel.names[0] == "layers")
            split = len(shape) - bias.value.ndim + lead
            shapes[path] = (*shape[:lead], math.prod(shape[lead:split]), math.prod(shape[split:]))
    return shapes


def output_major_kernels(params: dict, cfg: ModelConfig, dtype: Any = None) -> dict:
    """Every projection kernel as one (outputs, inputs) matrix (PyTorch's order), after any layers axis.

    The storage `projection.OUTPUT_MAJOR` names: XLA:CPU's one-row products stream it faster, so the
    sampler decodes a single row from it. `dtype`: the kernels' (None: unchanged).
    """
    shapes = _kernel_shapes(cfg)
    return jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.swapaxes(a.reshape(shapes[path]), -1, -2).astype(dtype or a.dtype)
        if path in shapes else a, params)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "output_major"))
def _prepare(params: Any, *, cfg: ModelConfig, dtype: str | None, output_major: bool) -> Any:
    params = nn.unbox(params)  # output_major_kernels finds kernels by their paths: without the logical-axes boxes
    if dtype is not None:
        params = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
    return output_major_kernels(params, cfg, jnp.float32) if output_major else params  # see `jaxgpt.ops.projection`


# The last weights prepared, while the caller still holds them: generating again from the same params (a
# chat loop, a benchmark, an evaluation) should not copy them again (a copy of every weight per call).
_prepared: list[tuple[list[weakref.ref], tuple, tuple[Any, ModelConfig]]] = []


def decoding_weights(params: Any, cfg: ModelConfig, dtype: str | None, *,
                     output_major: bool) -> tuple[Any, ModelConfig]:
    """The weights as the decode loop reads them, and the config it runs with.

    `dtype` (None: unchanged) casts the weights and makes the model compute in it: activations, the
    KV cache and the weight products run in `dtype`; norms, softmax and the logits stay float32
    (`GPT.logits`), and so does sampling. Batch-1 decoding reads every weight once per token, so
    bfloat16 halves the bytes per token on accelerators, but not on a CPU: XLA:CPU has no bfloat16
    one-row product and converts the weights to float32 (once per call, hoisted out of the loop), and
    the cache and attention stay float32 there (`attention.work_dtype`), so bf16 decodes at float32's
    speed (benchmarks/bench_sample.py prints both paths). `output_major` (`SamplerSpec.output_major`,
    set for batch 1 on CPUs: `output_major_for`) stores every kernel as one (outputs, inputs) float32
    matrix, the bf16-rounded values of a bf16 model included (the conversion XLA:CPU would make).
    """
    key = (cfg, dtype, output_major)
    leaves = jax.tree.leaves(params)
    for refs, seen, prepared in _prepared:
        if seen == key and len(refs) == len(leaves) and all(r() is a for r, a in zip(refs, leaves, strict=True)):
            return prepared
    if dtype is not None and (cfg.dtype, cfg.param_dtype) != (dtype, dtype):
        cfg = cfg.replace(dtype=dtype, param_dtype=dtype)  # UserError for an unknown dtype
    else:
        dtype = None
    if dtype is None and not output_major:
        return params, cfg
    prepared = _prepare(params, cfg=cfg, dtype=dtype, output_major=output_major), cfg
    refs: list[weakref.ref] = []
    entry = refs, key, prepared

    def forget(_: weakref.ref, cache: list = _prepared) -> None:  # the caller dropped its weights: so do we
        if entry in cache:
            cache.remove(entry)
    try:
        refs += [weakref.ref(a, forget) for a in leaves]
    except TypeError:  # a leaf that is not an array (a Python number) cannot be watched: no reuse
        return prepared
    _prepared[:] = [entry]
    return prepared
