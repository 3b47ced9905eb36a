"""Training throughput on this machine, measured in one run: tokens/s, model FLOP/s and the fraction
of the f32 matmul peak measured in the same process.

    python benchmarks/bench_train.py            # configs (a) and (b) of issue 3, a few model variants
    python benchmarks/bench_train.py --gpt2     # a few GPT-2 124M steps at batch 4 x 1024, peak memory

Uses the real train step (`jaxgpt.train_step.make_train_step`, jit with donation) on random tokens.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.flops import flops_per_token, measure_matmul_peak
from jaxgpt.model import GPT, init_params
from jaxgpt.optim import OptimConfig, make_optimizer
from jaxgpt.presets import get_preset
from jaxgpt.train_step import make_train_step

CONFIGS = {
    "(a) 4x4x128 T256 B32": (ModelConfig(vocab_size=100, block_size=256, n_layer=4, n_head=4, n_embd=128), 32),
    "(b) 6x6x384 T256 B16": (ModelConfig(vocab_size=100, block_size=256, n_layer=6, n_head=6, n_embd=384), 16),
}
VARIANTS = {"einsum attention": {}, "xla attention": {"attention_impl": "xla"}, "scan layers": {"scan_layers": True}}


def time_steps(cfg: ModelConfig, batch: int, steps: int) -> tuple[float, float]:
    """(compile seconds, median seconds per step) of the real jitted, donated train step."""
    model, tx = GPT(cfg), make_optimizer(OptimConfig(warmup_steps=1, decay_steps=1000))
    params = init_params(cfg, jax.random.key(0))
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (1, batch, cfg.block_size + 1), dtype=np.int32)
    data = {"x": jnp.asarray(tokens[..., :-1]), "y": jnp.asarray(tokens[..., 1:])}
    key = jax.random.key(1)
    t0 = time.perf_counter()
    step = jax.jit(make_train_step(model, tx), donate_argnums=(0,)).lower(state, data, key).compile()
    compile_s = time.perf_counter() - t0
    state, m = step(state, data, key)  # warm-up
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = step(state, data, key)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    return compile_s, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--gpt2", action="store_true", help="GPT-2 124M at batch 4 x 1024 instead")
    args = parser.parse_args()
    peak = measure_matmul_peak(2048, 10)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; f32 matmul peak (2048^2): {peak / 1e9:.0f} GFLOP/s")
    runs = ({"GPT-2 124M T1024 B4": (get_preset("gpt2"), 4)} if args.gpt2 else CONFIGS).items()
    print(f"{'config':<24}{'variant':<20}{'compile s':>10}{'step ms':>10}{'tokens/s':>11}{'GFLOP/s':>9}{'of peak':>9}")
    for name, (cfg, batch) in runs:
        for variant, changes in ({"einsum attention": {}} if args.gpt2 else VARIANTS).items():
            c = cfg.replace(**changes)
            compile_s, step_s = time_steps(c, batch, 3 if args.gpt2 else args.steps)
            tok_s = batch * c.block_size / step_s
            flops = tok_s * flops_per_token(c)
            print(f"{name:<24}{variant:<20}{compile_s:>10.1f}{step_s * 1e3:>10.0f}{tok_s:>11,.0f}"
                  f"{flops / 1e9:>9.1f}{flops / peak:>9.1%}", flush=True)
    print(f"peak resident memory of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
