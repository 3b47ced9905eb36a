"""Generation speed with and without the KV cache, measured in one run (issue 4's benchmark).

Measured when the decoding paths were written (2-core CPU; rerun for today's): output-major kernels
(`decode_weights.output_major_kernels`) took the GPT-2-shaped products per token from 150 to 130 us (qkv), 215 to 176
(fc) and 243 to 199 (proj), its MLP products 6.0 to 4.2 ms, while at 4 rows the declared order won (6.2 vs
10.6 ms); contracting in the kernel's order removed a copy that added a sixth to the weight traffic
(`ops.projection.einsum_in_kernel_order`); one stacked cache buffer for listed layers cost 30% tokens/s on
4x4x128 (`model.attention`); argmax's reduction took 215 us over 50,304 logits, 2% of a step, against 28 us
for a max and a min (`generate.strategies.first_argmax`); preparing decode weights copies GPT-2 124M in about
0.1 s (`generate.decode_weights.decoding_weights` keeps one prepared copy).

    python benchmarks/bench_sample.py                 # both char models, cached and uncached
    python benchmarks/bench_sample.py --skip_uncached # the cached loop only (the uncached larger model takes ~1 min)
    python benchmarks/bench_sample.py --routes_only   # only the batch-1 decoding routes and the transformers peer

Two character-level models of the training issue (random weights: speed does not depend on them), float32,
block 256, vocabulary 100: small 4 layers x 4 heads x 128 wide, larger 6 x 6 x 384. For each, 1 sample x 500
new tokens from a newline prompt:

* cached: `jaxgpt.generate.sampling.generate` (prefill, then one compiled while_loop with the KV cache; past 256
  tokens the window jumps by the default window_shift and is re-prefilled, as documented there);
  also `stream` in chunks of 16 tokens, the path the CLI prints from;
* uncached: `generate_uncached`, the naive loop that re-runs the jitted model on the whole current window
  for every token (what nanoGPT does, compiled; windows padded to powers of two);
* PyTorch eager, uncached (when torch is installed): nanoGPT's generation loop on the same model shape
  (benchmarks/torch_reference.py), the baseline issue 4's 20x target is stated against, timed in this run.

Compile time is measured separately (first call minus the best warm call) and kept out of tokens/s; timings
are the best of --repeats runs (the uncached 500-token run is timed once). The time per token at context ~16
and ~250 is 16 steps of the compiled loop from cache positions 16 and 239 (uncached: one token with a window
of that length). The machine may be shared: the load average is printed next to the numbers. Memory bandwidth
bounds batch-1 decoding (every step reads every weight), so the script also prints that bound per model and
the time XLA takes to multiply every weight matrix by one vector, the floor of any decode step.

Then the batch-1 decoding routes (issue 16) on the larger model and on a GPT-2 124M-shaped one (12 x 12 x 768,
vocabulary 50304, block 1024), each 1 x 500 sampled tokens, timed in rounds that run every route twice (the
second run timed, as bench_train does), so the ratios to the default path are measured side by side: float32
(the default, `generate`), float32 with every one-row projection padded to two rows (YNNPACK products;
attention, cache and sampling stay one row), float32 compiled with XLA's oneDNN option, float32 with the
weights split over two CPU devices (tensor parallel by the training rules table: both cores stream half the
weights, XLA adds the all-reduces), bfloat16 weights and activations (`generate(..., dtype="bfloat16")`),
bfloat16 with two-row products and bfloat16 with oneDNN. The peer is Hugging Face transformers' greedy
`generate` with its KV cache on a randomly initialized GPT2LMHeadModel of the same shape, float32, 2 torch
threads (when installed). The last row of each table is the memory bound of a float32 step: the bytes it must
read (weights and the KV cache) at the fastest streaming read XLA:CPU did in the same rounds, a bound for models
much larger than the last-level cache (GPT-2's 533 MB per token; 6x6x384's 47 MB partly stay in a 32 MB L3).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the uncached reference sampler
from reference import sampling_reference

from jaxgpt.commands import use_huge_pages
from jaxgpt.generate import sampling
from jaxgpt.generate.decode_weights import output_major_kernels
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import abstract_variables, init_params
from jaxgpt.model.layers import EinsumDense
from jaxgpt.train import sharding as layout
from jaxgpt.train.runtime import use_cpu_devices

Array = jax.Array

ROUTE_MODELS = {
    "larger 6x6x384": ModelConfig(vocab_size=100, block_size=256, n_layer=6, n_head=6, n_embd=384),
    "GPT-2 124M shape": ModelConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}
# (model, first word of the route) -> tokens/s, or "peer": at least 2.5x transformers' cached generate, or
# "bound": the memory bound, shown as the most any float32 route could reach against that peer.
ROUTE_TARGETS = {("larger 6x6x384", "float32"): 650, ("larger 6x6x384", "bfloat16"): 900,
                 ("GPT-2 124M shape", "float32"): "peer", ("GPT-2 124M shape", "bfloat16"): "peer",
                 ("GPT-2 124M shape", "memory"): "bound"}
MODELS = {
    "small 4x4x128": ModelConfig(vocab_size=100, block_size=256, n_layer=4, n_head=4, n_embd=128),
    "larger 6x6x384": ModelConfig(vocab_size=100, block_size=256, n_layer=6, n_head=6, n_embd=384),
}
TARGET_TOK_S = {"small 4x4x128": 6400, "larger 6x6x384": 650}
NEW_TOKENS, NEWLINE = 500, 0  # id 0 stands for "\n" (a sorted character vocabulary starts with it)
PROBE_STEPS = 16
CONTEXTS = (16, 256 - PROBE_STEPS - 1)  # steps at cache positions 16..31 and 239..254


def seconds(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` runs: on a shared machine the others measure the neighbours' load."""
    return min(seconds(fn) for _ in range(repeats))


def stream_probe() -> tuple[int, Callable[[], None]]:
    """(bytes, a compiled read of them): a one-row product with a 256 MiB (rows, 1024) matrix, much larger
    than any cache. Read the way batch-1 decoding reads its output-major kernels, on both cores, it
    streams faster than a jitted sum. The machines are shared: what a neighbour's memory traffic leaves
    varies from minute to minute, so the routes take it in turns with them (`bench_routes`)."""
    x = jnp.ones((64 * 1024, 1024), jnp.float32)
    row = jnp.ones((1, 1024), jnp.float32)
    product = jax.jit(lambda x, row: jax.lax.dot_general(row, x, (((1,), (1,)), ((), ()))))

    def run() -> None:
        product(x, row).block_until_ready()

    run()
    return x.nbytes, run


def memory_bandwidth_gb_s() -> float:
    """The fastest of five `stream_probe` reads, in GB/s."""
    nbytes, read = stream_probe()
    return nbytes / best_seconds(read, 5) / 1e9


def bytes_per_token(cfg: ModelConfig, new_tokens: int = NEW_TOKENS, rows: int = 1, prompt_len: int = 1,
                    itemsize: int = 4) -> int:
    """What one decode step of `rows` rows generating `new_tokens` after `prompt_len` must read, `itemsize`
    bytes a value (float32 by default): every weight but the position table (one row of it is read) once, and
    each row's KV cache as the sampler allocates it (`sampling.cache_slots`)."""
    params = abstract_variables(cfg)["params"]
    weights = sum(x.size for x in jax.tree.leaves(params))
    if "wpe" in params:
        weights -= math.prod(nn.unbox(params["wpe"]["embedding"]).shape)
    cache = 2 * cfg.n_layer * sampling.cache_slots(cfg, prompt_len, new_tokens) * cfg.n_kv_head * cfg.head_dim
    return itemsize * (weights + rows * cache)


def compiled_generation(params, cfg: ModelConfig, prompt: np.ndarray, new_tokens: int,
                        compiler_options: dict[str, Any] | None) -> Callable[[], np.ndarray]:
    """`generate(params, cfg, prompt, max_new_tokens=new_tokens, temperature=0, dtype="bfloat16")` with its decode
    loop (`sampling._run`) compiled with XLA `compiler_options` set over the ones it compiles with
    (`decode_weights.DECODE_OPTIONS`; e.g. `decode_weights.XLA_DECODE_DEFAULTS`): the same tokens, so a GPU run can
    time other options against `generate`'s."""
    req = sampling.request(cfg, prompt, num_samples=None, max_new_tokens=new_tokens, temperature=0, top_k=None,
                           top_p=None, key=0, eot_token=None, window_shift=None, return_logits=False, vocab_limit=None)
    weights, dcfg, state = sampling._start(params, cfg, req, "bfloat16")
    scalars = (jnp.int32(new_tokens), jnp.float32(0), jnp.float32(1))
    loop = sampling._run.lower(weights, state, *scalars, cfg=dcfg, spec=req.spec, num_steps=new_tokens).compile(
        compiler_options=compiler_options)

    def run() -> np.ndarray:
        return np.asarray(loop(weights, sampling._start(params, cfg, req, "bfloat16")[2], *scalars)[1])
    return run


def weights_matvec_seconds(params, cfg: ModelConfig, repeats: int) -> float:
    """The floor of a batch-1 decode step: every weight matrix times one vector, in decoding's order.

    A decode step reads each kernel once (and the tied embedding, for the logits), and each product
    needs the previous one's result: qkv -> out -> fc -> proj per layer, then the head. The chain
    here is exactly that sequence of products with nothing between them but a tanh, so no step of
    the model's can be faster. Timed like the decode loop: PROBE_STEPS rounds inside one compiled
    loop, each round starting from the previous round's result, so nothing is skipped or hoisted.
    """
    C = cfg.n_embd
    params = output_major_kernels(nn.unbox(params), cfg)  # (outputs, inputs) matrices, as the sampler reads one row
    mats = [params[f"h_{i}"][block][name]["kernel"] for i in range(cfg.n_layer)
            for block, name in (("attn", "qkv"), ("attn", "out"), ("mlp", "fc"), ("mlp", "proj"))]
    head = params["wte"]["embedding"]  # (V, C): output-major already

    @jax.jit
    def rounds(mats: list, head: Array) -> Array:
        def one_step(_, h_1C: Array) -> Array:
            h = h_1C
            for m_NK in mats:  # a product's input is the previous output (its first columns' worth after qkv)
                h = jnp.tanh(jax.lax.dot_general(h[:, : m_NK.shape[1]], m_NK, (((1,), (1,)), ((), ()))))
            return h + jnp.max(h @ head.T) * 1e-9
        return jax.lax.fori_loop(0, PROBE_STEPS, one_step, jnp.ones((1, C), jnp.float32))

    rounds(mats, head).block_until_ready()
    return best_seconds(lambda: rounds(mats, head).block_until_ready(), repeats) / PROBE_STEPS


def cached_per_token_at(params, cfg: ModelConfig, context: int, repeats: int) -> float:
    """Seconds per step of the compiled loop with `context` tokens in the cache (no re-prefill in reach).

    Times the loop itself (`sampling._run`, the function `generate` calls after the prefill) on a copy of
    a prefilled state, so neither the prefill nor a dispatch is in the number.
    """
    prompt = np.random.default_rng(context).integers(0, cfg.vocab_size, size=(1, context))
    req = sampling.request(cfg, prompt, num_samples=None, max_new_tokens=PROBE_STEPS, temperature=1.0, top_k=None,
                           top_p=None, key=1, eot_token=None, window_shift=None, return_logits=False,
                           vocab_limit=None)
    params, cfg, state = sampling._start(params, cfg, req, None)
    run = lambda st: sampling._run(params, st, jnp.int32(PROBE_STEPS), jnp.float32(1.0), jnp.float32(1.0), cfg=cfg,
                                   spec=req.spec, num_steps=PROBE_STEPS)
    jax.block_until_ready(run(jax.tree.map(jnp.copy, state)))
    times = []
    for _ in range(repeats):
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))
        times.append(seconds(lambda fresh=fresh: jax.block_until_ready(run(fresh))))
    return min(times) / PROBE_STEPS


def uncached_per_token_at(params, cfg: ModelConfig, context: int, repeats: int) -> float:
    """Seconds for one token of the naive loop with a `context`-token window (one forward pass + sampling)."""
    prompt = np.random.default_rng(context).integers(0, cfg.vocab_size, size=context)
    one = lambda: sampling_reference.generate_uncached(params, cfg, prompt, max_new_tokens=1, key=1)
    one()
    return best_seconds(one, repeats)


# ----------------------------------------------------------------------------------------------------
# Batch-1 decoding routes, timed interleaved against the default path (issue 16)


def _two_row_products(next_fun, args, kwargs, context):
    """A flax interceptor: a projection of one row runs on that row twice and keeps the first result.

    XLA:CPU hands one-row products to its matrix-vector emitter, two-row ones to YNNPACK
    (bf16 x bf16 -> f32 natively); attention, the cache and sampling stay one row.
    """
    module, x = context.module, args[0] if args else None
    projection = (isinstance(module, EinsumDense) and context.method_name == "__call__") or (
        isinstance(module, nn.Embed) and context.method_name == "attend")
    if projection and x.ndim == 3 and x.shape[0] * x.shape[1] == 1:
        return next_fun(jnp.concatenate([x, x]), *args[1:], **kwargs)[:1]
    return next_fun(*args, **kwargs)


class Route(NamedTuple):
    """A way to run the same decode loop: the dtype, a flax interceptor of the traced step (or None), XLA
    compile options, and how many CPU devices the weights are split over (tensor parallel, `layout`'s rules)."""

    dtype: str
    intercept: Callable | None = None
    options: dict | None = None
    tensor: int = 1


ROUTES = {
    "float32 (default)": Route("float32"),
    "float32, two-row products": Route("float32", _two_row_products),
    "float32, XLA oneDNN": Route("float32", options={"xla_cpu_use_onednn": True}),
    "float32, tensor-parallel on 2 devices": Route("float32", tensor=2),
    "bfloat16": Route("bfloat16"),
    "bfloat16, two-row products": Route("bfloat16", _two_row_products),
    "bfloat16, XLA oneDNN": Route("bfloat16", options={"xla_cpu_use_onednn": True}),
}
TENSOR_DEVICES = 2  # CPU devices made at start-up; single-device routes run on the first


def route_program(params, cfg: ModelConfig, route: str, new_tokens: int) -> Callable[[], np.ndarray]:
    """1 x `new_tokens` sampled tokens from a newline through the route's compiled loop: `generate`'s steps.

    The default route is `sampling.generate` itself. The others compile the same loop function
    (`sampling._run`) afresh, traced under the interceptor, with the weights split over `tensor` CPU
    devices by the training rules table (heads and the MLP's hidden axis; XLA inserts the all-reduces),
    and compiled with the options. Two-row products and split weights read the kernels as the modules
    declare them: output-major matrices (`SamplerSpec.output_major`) are for one row on one device.
    """
    r = ROUTES[route]
    if r == Route(r.dtype):
        return lambda: sampling.generate(params, cfg, [NEWLINE], max_new_tokens=new_tokens, key=1, dtype=r.dtype)
    req = sampling.request(cfg, [NEWLINE], num_samples=None, max_new_tokens=new_tokens, temperature=1.0, top_k=None,
                           top_p=None, key=1, eot_token=None, window_shift=None, return_logits=False, vocab_limit=None)
    spec = dataclasses.replace(req.spec, output_major=req.spec.output_major and not (r.intercept or r.tensor > 1))
    req = dataclasses.replace(req, spec=spec)
    scalars = (jnp.int32(new_tokens), jnp.float32(1.0), jnp.float32(1.0))
    loop = jax.jit(lambda *a, **k: sampling._run.__wrapped__(*a, **k),  # a new function: no cached trace
                   static_argnames=("cfg", "spec", "num_steps"), donate_argnames=("state",))
    placed = contextlib.nullcontext
    if r.tensor > 1:
        mesh = layout.make_mesh((1, 1, r.tensor), jax.devices()[:r.tensor])
        rules = layout.rules_for(layout.model_sizes(cfg), mesh)
        params = jax.device_put(params, layout.logical_to_sharding(
            nn.get_partition_spec(abstract_variables(cfg)["params"]), mesh, rules))
        placed = functools.partial(layout.activate, mesh, rules)
    start = functools.partial(sampling._start, params, cfg, req, r.dtype)  # the prepared weights are kept
    with placed():
        weights, decode_cfg, state = start()
        with nn.intercept_methods(r.intercept) if r.intercept else contextlib.nullcontext():
            compiled = loop.lower(weights, state, *scalars, cfg=decode_cfg, spec=spec,
                                  num_steps=new_tokens).compile(r.options or {})

    def run() -> np.ndarray:
        with placed():
            weights, _, state = start()
            return np.asarray(compiled(weights, state, *scalars)[1])
    return run


def bench_routes(name: str, cfg: ModelConfig, args: argparse.Namespace) -> list[dict]:
    """Every route's tokens/s, best of --repeats rounds that run each route once in turn."""
    params = init_params(cfg, jax.random.key(0))
    programs = {route: route_program(params, cfg, route, NEW_TOKENS) for route in ROUTES}
    for run in programs.values():
        run()  # compiles the default route's loop
    nbytes, stream = stream_probe()
    best = dict.fromkeys([*programs, stream], float("inf"))
    for _ in range(args.repeats):
        for route, run in programs.items():
            run()  # as bench_train.interleaved: memory the other routes freed may have gone back to the host
            best[route] = min(best[route], seconds(run))
        best[stream] = min(best[stream], best_seconds(stream, 3))
    bandwidth, read = nbytes / best.pop(stream) / 1e9, bytes_per_token(cfg)
    rows = [dict(model=name, route=route, tok_s=NEW_TOKENS / t) for route, t in best.items()]
    rows.append(dict(model=name, route=f"memory bound, f32: {read / 1e6:,.0f} MB at {bandwidth:.0f} GB/s",
                     tok_s=bandwidth * 1e9 / read))
    if torch_reference.available():
        hf_s = torch_reference.hf_generate_seconds(cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head,
                                                   cfg.n_embd, NEW_TOKENS)
        if hf_s is not None:
            rows.append(dict(model=name, route="transformers generate, KV cache, f32", tok_s=NEW_TOKENS / hf_s))
    return rows


def print_routes(rows: list[dict]) -> None:
    print(f"\nBatch-1 decoding routes, 1 x {NEW_TOKENS} sampled tokens each, best of --repeats rounds run in turn "
          f"(ratios are within this run); load average now {os.getloadavg()[0]:.1f}\n")
    header = f"| {'model':<17} | {'route':<37} | {'tokens/s':>9} | {'x default':>9} | {'target':>24} |"
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    default = {r["model"]: r["tok_s"] for r in rows if r["route"] == "float32 (default)"}
    peer = {r["model"]: r["tok_s"] for r in rows if r["route"].startswith("transformers")}
    for r in rows:
        target = ROUTE_TARGETS.get((r["model"], r["route"].split(",")[0].split(" ")[0]), "")
        if isinstance(target, int):
            target = f"{target:,} tok/s: {'meets' if r['tok_s'] >= target else 'misses'}"
        elif target and r["model"] in peer:
            ratio = r["tok_s"] / peer[r["model"]]
            target = (f"at most {ratio:.2f}x HF" if target == "bound" else
                      f"{ratio:.2f}x HF (2.5x): {'meets' if ratio >= 2.5 else 'misses'}")
        else:
            target = ""  # no peer in this run to state it against
        print(f"| {r['model']:<17} | {r['route']:<37} | {r['tok_s']:>9,.0f} | "
              f"{r['tok_s'] / default[r['model']]:>9.2f} | {target:>24} |", flush=True)


def bench_model(name: str, cfg: ModelConfig, args: argparse.Namespace) -> list[dict]:
    params = init_params(cfg, jax.random.key(0))
    rows = []

    def cached(prompt, n: int, stream: bool = False):
        if stream:
            return list(sampling.stream(params, cfg, prompt, max_new_tokens=n, key=1, chunk_size=16))
        return sampling.generate(params, cfg, prompt, max_new_tokens=n, key=1)

    first = seconds(lambda: cached([NEWLINE], NEW_TOKENS))
    warm = best_seconds(lambda: cached([NEWLINE], NEW_TOKENS), args.repeats)
    at16, at250 = (cached_per_token_at(params, cfg, c, 5 * args.repeats) for c in CONTEXTS)
    rows.append(dict(model=name, path="cached generate", compile=first - warm, tok_s=NEW_TOKENS / warm,
                     ms16=at16 * 1e3, ms250=at250 * 1e3))
    first = seconds(lambda: cached([NEWLINE], NEW_TOKENS, stream=True))
    warm = best_seconds(lambda: cached([NEWLINE], NEW_TOKENS, stream=True), args.repeats)
    rows.append(dict(model=name, path="cached stream (chunks of 16)", compile=first - warm, tok_s=NEW_TOKENS / warm))

    if not args.skip_uncached:
        def uncached(prompt, n: int):
            return sampling_reference.generate_uncached(params, cfg, prompt, max_new_tokens=n, key=1)

        # Compile every window bucket (1, 2, 4, ..., 256) with one-token runs, then time a full run.
        compile_s = sum(seconds(lambda b=b: uncached([NEWLINE] * b, 1)) for b in (1, 2, 3, 5, 9, 17, 33, 65, 129))
        total = seconds(lambda: uncached([NEWLINE], NEW_TOKENS))
        at16, at250 = (uncached_per_token_at(params, cfg, c, args.repeats) for c in CONTEXTS)
        rows.append(dict(model=name, path="uncached (full window each token)", compile=compile_s,
                         tok_s=NEW_TOKENS / total, ms16=at16 * 1e3, ms250=at250 * 1e3))
    if torch_reference.available():
        torch_s = torch_reference.uncached_generate_seconds(cfg.vocab_size, cfg.block_size, cfg.n_layer,
                                                            cfg.n_head, cfg.n_embd, NEW_TOKENS)
        rows.append(dict(model=name, path="PyTorch eager, uncached", compile=0.0, tok_s=NEW_TOKENS / torch_s))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip_uncached", action="store_true", help="only the cached loop")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions (the best is reported)")
    parser.add_argument("--routes_only", action="store_true", help="only the batch-1 decoding routes and peers")
    args = parser.parse_args()
    def routes() -> None:
        for name, cfg in ROUTE_MODELS.items():  # a table per model, printed as soon as it is measured
            print_routes(bench_routes(name, cfg, args))

    if args.routes_only:
        print(f"jax {jax.__version__}, {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}")
        routes()
        return

    bandwidth = memory_bandwidth_gb_s()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} x{len(jax.devices())}, {os.cpu_count()} CPU cores, "
          f"load average {os.getloadavg()[0]:.1f} (a shared machine slows everything down); "
          f"memory read bandwidth {bandwidth:.1f} GB/s")
    rows, floors = [], {}
    for name, cfg in MODELS.items():
        rows += bench_model(name, cfg, args)
        params = init_params(cfg, jax.random.key(0))
        n_params = sum(x.size for x in jax.tree.leaves(params))
        bound = bandwidth * 1e9 / (4 * n_params)
        floor = weights_matvec_seconds(params, cfg, 20 * args.repeats)
        floors[name] = floor
        print(f"{name}: {n_params / 1e6:.2f}M parameters = {4 * n_params / 1e6:.1f} MB of f32 weights read per "
              f"token -> at most ~{bound:,.0f} tokens/s at batch 1 if they stream from memory "
              f"(more if they stay in cache); the weight matrices times one vector, one after another as a "
              f"decode step needs them, alone take {floor * 1e3:.3f} ms -> at most {1 / floor:,.0f} tokens/s",
              flush=True)

    print(f"\n1 sample x {NEW_TOKENS} new tokens, float32, block 256 (window_shift "
          f"{sampling.default_window_shift(MODELS['small 4x4x128'])} past the block); "
          f"load average now {os.getloadavg()[0]:.1f}\n")
    header = f"| {'model':<15} | {'path':<33} | {'compile s':>9} | {'tokens/s':>9} | {'ms/token @16':>12} | " \
             f"{'ms/token @250':>13} | {'@250 / @16':>10} | {'target tok/s':>12} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        ratio = f"{r['ms250'] / r['ms16']:.2f}" if r.get("ms16") else ""
        target = TARGET_TOK_S[r["model"]] if r["path"].startswith("cached") else ""
        ms16 = f"{r['ms16']:.3f}" if "ms16" in r else ""
        ms250 = f"{r['ms250']:.3f}" if "ms250" in r else ""
        print(f"| {r['model']:<15} | {r['path']:<33} | {r['compile']:>9.2f} | {r['tok_s']:>9,.0f} | {ms16:>12} | "
              f"{ms250:>13} | {ratio:>10} | {target!s:>12} |")
    cached = {r["model"]: r for r in rows if r["path"] == "cached generate"}
    uncached = {r["model"]: r for r in rows if r["path"].startswith("uncached")}
    torch_rows = {r["model"]: r for r in rows if r["path"].startswith("PyTorch")}
    print()
    for name, r in cached.items():
        speedup = f", {r['tok_s'] / uncached[name]['tok_s']:.0f}x the uncached loop" if name in uncached else ""
        if name in torch_rows:
            ratio = r["tok_s"] / torch_rows[name]["tok_s"]
            speedup += f", {ratio:.0f}x PyTorch eager uncached in this run ({'meets' if ratio >= 20 else 'misses'} 20x)"
        verdict = "meets" if r["tok_s"] >= TARGET_TOK_S[name] else "misses"
        flat = "meets" if r["ms250"] <= 1.5 * r["ms16"] else "misses"
        print(f"{name}: {r['tok_s']:,.0f} tokens/s {verdict} the target {TARGET_TOK_S[name]:,}{speedup}; "
              f"per-token time at 250 / at 16 = {r['ms250'] / r['ms16']:.2f} {flat} the <= 1.5 target; "
              f"decode steps take {r['ms16'] / 1e3 / floors[name]:.2f}x the chained weight products alone, "
              f"which allow at most {1 / floors[name]:,.0f} tokens/s")
    routes()


if __name__ == "__main__":
    use_cpu_devices(TENSOR_DEVICES)  # before any computation
    use_huge_pages()  # as train.py and sample.py do
    main()
