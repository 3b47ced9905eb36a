"""The weights as the sampler's decode loop reads them (cast to the decoding dtype, laid out for one row), and the
loop of decode steps as each backend runs it fastest (`token_loop`).

Batch-1 decoding reads every weight once per token, so their layout decides its speed on CPUs and GPUs
(`output_major_for`, `jaxgpt.ops.projection`). The sampler asks here for the weights and for the kernel
storage the model then declares (`kernel_storage`); what the storage changes in the model is only the parameters
it declares (each kernel's matrix shape, grouped-query attention's one `qkv`), never what it computes. The
prepared copy is kept while the caller holds the weights it came from, so generating again from the same
weights does not copy them again.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import abstract_variables
from jaxgpt.ops.platform import current_platform, on_gpu
from jaxgpt.ops.projection import DECLARED, OUTPUT_MAJOR


def output_major_for(batch: int) -> bool:
    """Whether the decode loop reads output-major kernels (`output_major_kernels`): batch 1 on CPUs and GPUs.

    XLA:CPU's one-row product streams them faster; from a few rows on, its matrix products prefer the
    declared order (benchmarks/bench_sample.py prints both). XLA:GPU rewrites a one-row product into a
    multiply and a reduction (its dot strength reduction, below ten million weights): over the declared
    (inputs, outputs) kernel that is a column reduction, which it did not fuse with the multiply for the MLP's
    output projection, so each token wrote and read back a product as large as the kernel; over an
    output-major kernel it is a row reduction, one kernel reading the weights once
    (tests/compile/test_decode_program.py). TPUs choose their own layouts.
    """
    return batch == 1 and (current_platform() == "cpu" or on_gpu())


def kernel_storage(output_major: bool) -> str:
    """The storage the model declares its kernels in (`EinsumDense.kernel_storage`) for `decoding_weights`'s
    weights."""
    return OUTPUT_MAJOR if output_major else DECLARED


@functools.cache
def _kernel_shapes(cfg: ModelConfig) -> dict[tuple, tuple[int, ...]]:
    """Each projection kernel's path -> its shape as a matrix: ([layers,] inputs, outputs).

    Kernels keep a stacked-layers axis first, then their input axes, then their output axes, which are
    the bias's axes: a model with biases tells each kernel's split, whatever `use_bias` and `qkv_bias` say. Norm
    scales are no kernels: (H, D) ones (qk_norm_site "projection") stay as they are.
    """
    boxed = abstract_variables(cfg.replace(use_bias=True, qkv_bias=True))["params"]
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

    The storage `projection.OUTPUT_MAJOR` names: one-row products read it faster on CPUs and GPUs
    (`output_major_for`), so the sampler decodes a single row from it. `dtype`: the kernels' (None: unchanged).
    Grouped-query attention's `q` and `kv` become one `qkv` projection (`_stack_grouped_qkv`).
    """
    shapes = _kernel_shapes(cfg)
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.swapaxes(a.reshape(shapes[path]), -1, -2).astype(dtype or a.dtype)
        if path in shapes else a, params)
    return _stack_grouped_qkv(params, cfg) if cfg.n_kv_head != cfg.n_head else params


def _stack_grouped_qkv(tree: Mapping, cfg: ModelConfig) -> dict:
    """Each self-attention's (`attn`) output-major `q` and `kv` as one `qkv`: the q rows, then kv's (its keys'
    heads, then its values'), which `model.attention.Attention` declares for output-major storage and splits
    after the product. Biases (H, D) and (2, K, D) stack to (H + 2K, D); a layers axis stays first."""
    out = {}
    for name, node in tree.items():
        if name == "attn" and {"q", "kv"} <= node.keys():
            q, kv = node["q"], node["kv"]
            stacked = {"kernel": jnp.concatenate([q["kernel"], kv["kernel"]], axis=-2)}
            if "bias" in q:
                kv_bias = kv["bias"].reshape(*kv["bias"].shape[:-3], 2 * cfg.n_kv_head, cfg.head_dim)
                stacked["bias"] = jnp.concatenate([q["bias"], kv_bias], axis=-2)
            node = {**{k: v for k, v in node.items() if k not in ("q", "kv")}, "qkv": stacked}
        out[name] = _stack_grouped_qkv(node, cfg) if isinstance(node, Mapping) else node
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "output_major"))
def _prepare(params: Any, *, cfg: ModelConfig, dtype: str | None, output_major: bool) -> Any:
    params = nn.unbox(params)  # output_major_kernels finds kernels by their paths: without the logical-axes boxes
    if dtype is not None:
        params = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
    if not output_major:
        return params
    # float32 on CPUs (see `jaxgpt.ops.projection`); GPUs read the decoding dtype's, half the bytes
    return output_major_kernels(params, cfg, jnp.float32 if current_platform() == "cpu" else None)


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
    set for batch 1 on CPUs and GPUs: `output_major_for`) stores every kernel as one (outputs, inputs) matrix:
    float32 on CPUs, the bf16-rounded values of a bf16 model included (the conversion XLA:CPU would make),
    in `dtype` on GPUs.
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
        # by identity: `in` would compare another entry's arrays with ==, whose truth is ambiguous
        cache[:] = [e for e in cache if e is not entry]
    try:
        refs += [weakref.ref(a, forget) for a in leaves]
    except TypeError:  # a leaf that is not an array (a Python number) cannot be watched: no reuse
        return prepared
    _prepared[:] = [entry]
    return prepared


# Decode steps per trip of a compiled loop on accelerators (`token_loop`): one trip is one launch of its body.
UNROLL = 2
# XLA:GPU's default command-buffer types (jax 0.11 and 0.12): a loop's body runs as one CUDA graph per trip, the
# loop itself on the host.
XLA_COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
# The same plus WHILE and CONDITIONAL: a decode program's loops and branches run inside its CUDA graph (conditional
# nodes, CUDA 12.3 and later; XLA leaves them out on older drivers), so a whole generation is one launch.
WHILE_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": f"{XLA_COMMAND_BUFFERS},WHILE,CONDITIONAL"}
# XLA:GPU's experimental Triton fusion of whole chains of elementwise ops, reductions and their broadcasts: a
# batch-1 GPT-2 decode step launches 5 kernels a layer instead of 13 (each layer norm fused with the projection it
# feeds, the QKV projection as one: tests/compile/test_decode_program.py; 79 a token on jax 0.12, 91 on 0.11.2).
TRITON_FUSION = {"xla_gpu_experimental_enable_triton_heroless_priority_fusion": True}
# What `generate`'s decode loop compiles with (`sampling._run`): each decoded GPT-2 124M faster than XLA's settings
# on an H200, timed in turns (docs/benchmarks.md, "One H200, again"), and device_check's generate part times the
# pair against XLA_DECODE_DEFAULTS and each option left out. Only XLA:GPU reads these options; XLA:CPU and TPUs
# compile as without them.
DECODE_OPTIONS = {**WHILE_COMMAND_BUFFERS, **TRITON_FUSION}
# XLA:GPU's own settings of the same options, to time DECODE_OPTIONS against.
XLA_DECODE_DEFAULTS = {"xla_gpu_enable_command_buffer": XLA_COMMAND_BUFFERS,
                       "xla_gpu_experimental_enable_triton_heroless_priority_fusion": False}


def fixed_trip_counts() -> bool:
    """Whether decode loops run a fixed number of steps (`token_loop`): on every backend but XLA:CPU.

    XLA:GPU reads the condition of a while loop whose trip count it does not know on the host, after every
    trip (openxla/xla's WhileThunk copies it to the host and waits for the device), so each token cost a host
    round trip and the launch of its body's kernels one by one; a loop of known trip count it runs without
    reading anything back, and can capture whole as a CUDA graph. XLA:CPU evaluates the condition where it runs,
    for free, and stops at the first false one, where a fixed count would run the masked steps too.
    """
    return current_platform() != "cpu"


# The most tokens one trip of an outer decode loop runs with fixed trip counts (`fixed_trip_counts`): that loop,
# whose trip count depends on the tokens (every row may end), costs a host round trip per trip there.
TRIP_TOKENS = 32


def trip_tokens(num_steps: int, most: int) -> int:
    """Steps per trip of a decode loop's inner `token_loop` for `num_steps` steps in all: at most `most`, and with
    fixed trip counts at most TRIP_TOKENS, the steps spread evenly over the trips so that few run masked."""
    if not fixed_trip_counts():
        return most
    trips = -(-num_steps // min(most, TRIP_TOKENS))
    return -(-num_steps // trips)


def token_loop(steps: int, live: Callable[[Any], Any], step: Callable[[Any, Any, Any], Any], carry: Any) -> Any:
    """`step(i, carry, commit)` for i = 0 .. steps - 1 while `live(carry)`, as one compiled loop.

    `live` must stay false once false (the decode loops' "a row may still sample"). On XLA:CPU a while loop stops
    at the first false `live` and every step commits (`commit` is True); elsewhere (`fixed_trip_counts`) the
    loop always runs `steps` trips, UNROLL steps per trip, and a step after `live` turned false gets `commit`
    False: it must then leave the carry as it found it wherever that matters to the caller.
    """
    if not fixed_trip_counts():
        def one(c: tuple) -> tuple:
            return c[0] + 1, step(c[0], c[1], True)
        return jax.lax.while_loop(lambda c: (c[0] < steps) & live(c[1]), one, (jnp.int32(0), carry))[1]
    return jax.lax.fori_loop(0, steps, lambda i, c: step(i, c, live(c)), carry, unroll=min(UNROLL, steps))
