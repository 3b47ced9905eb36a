"""The two GPT decoders side by side: `sampling.generate` (one compiled loop per call) and the engine
(`many.generate_many`, continuous batching), in tokens/s, on the same prompts and seeds in one run.

Two cases per model: one prompt of 16 tokens and 200 new tokens (what `jaxgpt sample --prompt` decodes), and 16
prompts of 4 to 64 tokens with 128 new tokens each (a requests file: `generate` takes them one call each, as it
takes only rectangular batches; the engine as 16 slots). Random weights (speed does not depend on them), float32,
block 256. Each path is compiled first, then timed in rounds that run both paths (the machine may be shared:
the load average is printed); best and median of the rounds. Both paths must give the same tokens.

    python benchmarks/bench_decoders.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxgpt.generate import sampling
from jaxgpt.generate.many import generate_many
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import init_params

MODELS = {"small 4x4x128": ModelConfig(vocab_size=100, block_size=256, n_layer=4, n_head=4, n_embd=128),
          "larger 6x6x384": ModelConfig(vocab_size=100, block_size=256, n_layer=6, n_head=6, n_embd=384)}


def paths(params, cfg: ModelConfig, prompts: list[list[int]], n: int) -> dict[str, Callable[[], list[list[int]]]]:
    seeds = list(range(len(prompts)))
    one = lambda p, s: sampling.generate(params, cfg, np.array(p, np.int32), max_new_tokens=n, key=s, temperature=1.0)
    return {
        "generate": lambda: [one(p, s)[0].tolist() for p, s in zip(prompts, seeds, strict=True)],
        "engine": lambda: generate_many(params, cfg, prompts, max_new_tokens=n, seeds=seeds, temperature=1.0,
                                        slots=len(prompts)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (each runs both paths)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for name, cfg in MODELS.items():
        params = init_params(cfg, jax.random.key(0))
        one = [rng.integers(1, cfg.vocab_size, 16).tolist()]
        ragged = [rng.integers(1, cfg.vocab_size, int(k)).tolist() for k in rng.integers(4, 65, 16)]
        for case, prompts, n in (("1 prompt", one, 200), ("16 ragged prompts", ragged, 128)):
            runs = paths(params, cfg, prompts, n)
            outputs = {k: run() for k, run in runs.items()}  # compiles
            seconds: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(args.rounds):
                for k, run in runs.items():
                    start = time.perf_counter()
                    run()
                    seconds[k].append(time.perf_counter() - start)
            tokens = len(prompts) * n
            rates = ", ".join(f"{k} {tokens / min(s):,.0f} tokens/s (median {tokens / statistics.median(s):,.0f})"
                              for k, s in seconds.items())
            print(f"{name}, {case}: {rates}; engine / generate {min(seconds['generate']) / min(seconds['engine']):.2f}"
                  f"; same tokens: {outputs['generate'] == outputs['engine']}; load {os.getloadavg()[0]:.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
