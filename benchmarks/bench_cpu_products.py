"""The products behind issue 16's CPU targets, timed alone: what XLA:CPU makes of each way to write them.

    python benchmarks/bench_cpu_products.py

Batch-1 decoding is a chain of weight products with one row; training is three products per weight
matrix (forward X W, input gradient dY W^T, weight gradient X^T dY). Whether bfloat16 can be faster than
float32, and whether two cores can share a decode step, is decided here, below the model:

* decode chains: every weight matrix of a model times one row (qkv -> out -> fc -> proj per layer, as a
  decode step needs them, 16 steps inside one compiled loop, best of --repeats calls), for the 6x6x384
  model and the GPT-2 124M shape (without the tied head). Routes: float32 one row, with the kernel
  stored (K, N) as the model declares it and stored (N, K) as the sampler decodes one row from it
  (`generate.decode_weights.output_major_kernels`); bfloat16 one row;
  bfloat16 padded to two rows (kernel stored (K, N) as the model stores it, and stored (N, K)); float32
  split by columns over two CPU devices with the all-gather each product then needs, and without it
  (the bound of splitting, not a correct program).
* training products at the 6x6x384 fc layer's shape, 16 x 256 rows: float32; bfloat16 as written; for the
  weight gradient also bfloat16 with X^T materialized first, and as jaxgpt's bf16 projections compute it
  (`ops.projection._weight_gradient`: two products over halves of an explicit X^T).

Each row prints the time, the ratio to its float32 row, and what the compiled HLO holds: YNNPACK fusions
(XLA:CPU's native bf16 x bf16 -> f32 products) and converts (bf16 upcast to f32 before a float32 product).
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxgpt.ops.projection import _weight_gradient
from jaxgpt.train.runtime import use_cpu_devices

STEPS = 16  # chain rounds inside one compiled loop
CHAINS = {"6x6x384": (384, 6), "GPT-2 124M shape": (768, 12)}  # width, layers
TRAIN_SHAPE = (16 * 256, 384, 1536)  # rows, K, N: the (b) config's fc layer


def hlo_counts(compiled: jax.stages.Compiled) -> str:
    text = compiled.as_text()
    library = len(re.findall(r"= \S+ fusion\(.*kind=kCustom", text))
    return f"{library} YNNPACK fusions, {text.count(' convert(')} converts"


def best_ms(compiled: Callable, args: tuple, repeats: int) -> float:
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def chain_rows(C: int, layers: int, repeats: int) -> list[tuple[str, float, str]]:
    rng = np.random.default_rng(0)
    shapes = [s for _ in range(layers) for s in ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C))]
    kernels = [rng.standard_normal(s).astype(np.float32) * 0.02 for s in shapes]

    def program(dtype, rows: int, transposed: bool = False):
        ws = [jnp.asarray(w.T if transposed else w, dtype) for w in kernels]
        contract = 1 if transposed else 0

        def chain(ws: list, x):
            def step(_, h):
                for w in ws:  # each product reads the previous one's output
                    dims = (((1,), (contract,)), ((), ()))
                    h = jnp.tanh(jax.lax.dot_general(h[:, :w.shape[contract]].astype(dtype), w, dims,
                                                     preferred_element_type=jnp.float32))
                return h
            return jax.lax.fori_loop(0, STEPS, step, x)
        x = jnp.ones((rows, C), jnp.float32)
        return jax.jit(chain).lower(ws, x).compile(), (ws, x)

    def split(gather: bool):
        mesh = jax.make_mesh((2,), ("t",), devices=jax.devices()[:2])
        ws = [jax.device_put(jnp.asarray(w), NamedSharding(mesh, P(None, "t"))) for w in kernels]

        def chain(ws: list, x):
            def step(_, h):
                for w in ws:
                    y = jnp.tanh(h[:, :w.shape[0]] @ w)  # this device's half of the columns
                    h = jax.lax.all_gather(y, "t", axis=1, tiled=True) if gather else jnp.concatenate([y, y], 1)
                return h
            return jax.lax.fori_loop(0, STEPS, step, x)
        body = jax.shard_map(chain, mesh=mesh, in_specs=(P(None, "t"), P()), out_specs=P(), check_vma=False)
        x = jnp.ones((1, C), jnp.float32)
        return jax.jit(body).lower(ws, x).compile(), (ws, x)

    routes = {
        "float32, one row": lambda: program(jnp.float32, 1),
        "float32, one row, kernel (N, K) (the sampler's)": lambda: program(jnp.float32, 1, transposed=True),
        "bfloat16, one row": lambda: program(jnp.bfloat16, 1),
        "bfloat16, two rows, kernel (K, N)": lambda: program(jnp.bfloat16, 2),
        "bfloat16, two rows, kernel (N, K)": lambda: program(jnp.bfloat16, 2, transposed=True),
        "float32, columns on 2 devices + all-gather": lambda: split(gather=True),
        "float32, columns on 2 devices, no collective": lambda: split(gather=False),
    }
    rows = []
    for name, make in routes.items():
        compiled, args = make()
        rows.append((name, best_ms(compiled, args, repeats) / STEPS, hlo_counts(compiled)))
        del compiled, args  # one route's weights in memory at a time: the others would evict them from cache
    return rows


def training_rows(repeats: int) -> list[tuple[str, float, str]]:
    M, K, N = TRAIN_SHAPE
    rng = np.random.default_rng(0)
    x, dy, w = (rng.standard_normal(s).astype(np.float32) for s in ((M, K), (M, N), (K, N)))
    dot = lambda a, b, dims: jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)
    products = {
        "forward X W": (lambda x, dy, w: dot(x, w, ((1,), (0,))), None),
        "input gradient dY W^T": (lambda x, dy, w: dot(dy, w, ((1,), (1,))), None),
        "weight gradient X^T dY": (lambda x, dy, w: dot(x, dy, ((0,), (0,))), {
            "X^T materialized": lambda x, dy, w: dot(jax.lax.optimization_barrier(x.T), dy, ((1,), (0,))),
            "halves of X^T (jaxgpt)": lambda x, dy, w: _weight_gradient(x, dy)}),
    }
    rows = []
    for name, (plain, others) in products.items():
        variants = [("float32", plain, jnp.float32), ("bfloat16", plain, jnp.bfloat16)]
        variants += [(f"bfloat16, {label}", fn, jnp.bfloat16) for label, fn in (others or {}).items()]
        for label, fn, dtype in variants:
            args = tuple(jnp.asarray(a, dtype) for a in (x, dy, w))
            compiled = jax.jit(fn).lower(*args).compile()
            rows.append((f"{name}: {label}", best_ms(compiled, args, repeats), hlo_counts(compiled)))
    return rows


def print_rows(title: str, rows: list[tuple[str, float, str]], unit: str) -> None:
    """A table; "x float32" is the speed-up over the first row of the same product (the text before ":")."""
    print(f"\n{title}\n")
    print(f"| {'route':<58} | {unit:>10} | {'x float32':>9} | compiled HLO |")
    print(f"|{'-' * 60}|{'-' * 12}|{'-' * 11}|--------------|")
    base: dict[str, float] = {}
    for name, ms, counts in rows:
        first = base.setdefault(name.split(":")[0] if ":" in name else "", ms)
        print(f"| {name:<58} | {ms:>10.3f} | {first / ms:>9.2f} | {counts} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per row (the fastest is reported)")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {len(jax.devices())} CPU devices")
    for name, (C, layers) in CHAINS.items():
        print_rows(f"Decode chain, {name}: every weight matrix x one row, per step",
                   chain_rows(C, layers, args.repeats), "ms/step")
    M, K, N = TRAIN_SHAPE
    print_rows(f"Training products, {M} x {K} x {N}", training_rows(args.repeats), "ms")


if __name__ == "__main__":
    use_cpu_devices(2)  # before any computation; single-device rows use the first
    main()
