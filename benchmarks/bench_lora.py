"""LoRA's and QLoRA's cost against full fine-tuning, measured in one run: the compiled peak memory of one training
step, the step time and the trainable share, on the SmolLM2-135M shape (random weights) with adapters on every linear
layer of the blocks.

    python benchmarks/bench_lora.py                              # rank 16, batch 2 x 128, scanned layers
    python benchmarks/bench_lora.py --batch 8 --block 512 --steps 5

Each row is the trainer's own step (`jaxgpt.train.step.make_train_step`, AdamW, jit with the state donated) on
random tokens: "full" trains every weight; "lora" trains the adapters beside the frozen float base, which the step
receives as its frozen argument and applies unmerged (`jaxgpt.model.lora.overlay`), as `jaxgpt.train.lora.Adapted`
does; "qlora int8" and "qlora nf4" hold that base quantized (`jaxgpt.model.quant`). Memory is XLA's
`compiled.memory_analysis()` of each step: argument + temp + output - alias bytes (the donated state's outputs
reuse its buffers, so it counts once), the peak a step needs on a device; step time is the fastest of --steps steps
after a first one. The targets (issue 63): LoRA's peak <= 0.5x full fine-tuning's, QLoRA 4-bit's <= 0.35x, LoRA's
step time <= 1.0x, the trainable parameters (and so their gradients and Adam moments) <= 5%.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxgpt.model import lora, quant
from jaxgpt.model.gpt import GPT, abstract_variables, init_params
from jaxgpt.model.presets import get_preset
from jaxgpt.train.step import make_train_step


def cross_entropy(model: GPT, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def measure(loss: Any, trainable: Any, frozen: tuple, batch: dict, steps: int) -> dict[str, float]:
    """Compiled memory (bytes) and the fastest step (s) of training `trainable` with `loss`."""
    tx = optax.adamw(1e-4)
    n_trainable = sum(x.size for x in jax.tree.leaves(trainable))
    state = {"params": trainable, "opt_state": tx.init(trainable), "step": jnp.int32(0)}
    step = jax.jit(make_train_step(loss, tx), donate_argnums=(0,))
    key = jax.random.key(0)
    compiled = step.lower(state, batch, key, *frozen).compile()
    m = compiled.memory_analysis()
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        state, metrics = compiled(state, batch, key, *frozen)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t)
    return {"argument": m.argument_size_in_bytes, "temp": m.temp_size_in_bytes, "output": m.output_size_in_bytes,
            "alias": m.alias_size_in_bytes,
            "peak": m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes,
            "step_s": min(times[1:]), "trainable": n_trainable}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--listed", action="store_true", help="listed layers (default: scanned, which compiles faster)")
    args = p.parse_args()
    cfg = get_preset(args.preset).replace(block_size=args.block, scan_layers=not args.listed)
    model = GPT(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.batch, args.block + 1))
    batch = {"x": jnp.asarray(tokens[..., :-1]), "y": jnp.asarray(tokens[..., 1:])}  # one micro-batch
    base = init_params(cfg, jax.random.key(0))
    boxed = abstract_variables(cfg)["params"]
    found = lora.sites(boxed, (), args.rank)
    adapters = nn.unbox(lora.init_adapters(found, jax.random.key(1)))
    s = lora.scale(16.0, args.rank, False)

    def adapted_loss(a: Any, b: dict, key: jax.Array, frozen: Any) -> tuple[jax.Array, dict]:
        return cross_entropy(model, lora.overlay(jax.lax.stop_gradient(frozen), a, s), b), {}

    host = jax.device_get(base)
    rows = {"lora": (adapters, (base,))}
    for kind in lora.QUANTIZE:
        rows[f"qlora {kind}"] = (adapters, (jax.device_put(quant.quantize_base(host, boxed, kind, 64)[0]),))
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # each step donates (deletes) the state it is given
    full_loss = lambda prm, b, key: (cross_entropy(model, prm, b), {})
    results = {"full": measure(full_loss, copy(base), (), batch, args.steps)}
    for name, (trainable, frozen) in rows.items():
        results[name] = measure(adapted_loss, copy(trainable), frozen, batch, args.steps)
    full = results["full"]
    print(f"{args.preset}, rank {args.rank} on every linear layer of the blocks, batch {args.batch} x {args.block}, "
          f"{'listed' if args.listed else 'scanned'} layers, {jax.devices()[0].platform}")
    print(f"{'':12} {'peak MiB':>9} {'(arg':>7} {'temp':>7} {'out':>7} {'alias)':>7} {'x full':>7} {'step ms':>8} "
          f"{'x full':>7} {'trainable':>12}")
    mib = 2 ** 20
    for name, r in results.items():
        print(f"{name:12} {r['peak'] / mib:9.0f} {r['argument'] / mib:7.0f} {r['temp'] / mib:7.0f} "
              f"{r['output'] / mib:7.0f} {r['alias'] / mib:7.0f} {r['peak'] / full['peak']:7.3f} "
              f"{1000 * r['step_s']:8.0f} {r['step_s'] / full['step_s']:7.3f} "
              f"{r['trainable']:>12,} ({r['trainable'] / full['trainable']:.2%})")
    print("targets: lora peak <= 0.5x, qlora nf4 peak <= 0.35x, lora step <= 1.0x, trainable <= 5%")


if __name__ == "__main__":
    main()
