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

    python benchmarks/bench_lora.py --checkpoint_size            # one full and one LoRA train state on disk

--checkpoint_size writes a full fine-tuning train state (every weight and its AdamW moments, the trainer's own
optimizer) and a LoRA one (the adapters and theirs) at that shape through the runs' own checkpointer
(`jaxgpt.io.checkpoint.Checkpointer`, orbax) into a temporary directory, and prints both sizes on disk and their
ratio (target: LoRA's <= 5%). No step is taken: every value is drawn at random instead, as a trained state's are,
since orbax compresses what it writes and an initialized state's zeros (the moments, LoRA's B) would take next to
no space.

    python benchmarks/bench_lora.py --quality                    # full chat SFT vs LoRA chat SFT, same base and steps

--quality measures what LoRA gives up instead: one base (the quick start's model, configs/stdlib_char.py, trained
for --base_steps into --base if it holds no run, as benchmarks/bench_rl.py and bench_dpo.py build theirs), then
configs/chat_sft.py from it twice for the same --sft_steps on the same batches: every weight trained (its own
learning rate), and LoRA of --rank on every linear layer of the blocks (--lora_lr: LoRA's update s A B moves less
per step than a weight of its own, and B starts at zero, so it takes a larger rate; "LoRA Without Regret",
Thinking Machines 2025, measures the best at about 10x full fine-tuning's). Both are scored on the same held-out
conversations by the task's own evaluation: greedy exact match (every answer token the argmax, so greedy decoding
writes the answer). A third run (unless --lora_save is "") is the same LoRA with whole parameters trained in full
beside the adapters (config.lora.modules_to_save, PEFT's modules_to_save) at --lora_save_lr (4e-3): on this small,
barely pretrained base the task must relearn the token and position tables, the norms and the biases, which no
adapter reaches. It prints each, the ratios (target: LoRA >= 0.95x full SFT) and the size on disk of each run's
last checkpoint (target: LoRA's <= 5% of full fine-tuning's). --seed picks the SFT runs' seed (batches, init).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench_rl import config, trained

from jaxgpt.data.conversations import by_kind_text
from jaxgpt.io.checkpoint import Checkpointer, checkpoint_dir
from jaxgpt.model import lora, quant
from jaxgpt.model.gpt import GPT, abstract_variables, init_params
from jaxgpt.model.presets import get_preset
from jaxgpt.tasks import build
from jaxgpt.train.config import from_config_dict
from jaxgpt.train.loop import train
from jaxgpt.train.optim import OptimConfig, make_optimizer
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


def checkpoint_bytes(workdir: Path) -> int:
    """Bytes on disk of the run's last checkpoint (every file of its step directory)."""
    step = Checkpointer(workdir, read_only=True).latest_step()
    return sum(f.stat().st_size for f in Path(checkpoint_dir(workdir) / str(step)).rglob("*") if f.is_file())


def checkpoint_sizes(states: dict[str, Any]) -> dict[str, int]:
    """Bytes on disk of each train state (its params; the trainer's AdamW moments added here), every float drawn
    at random (incompressible, as trained values are), saved by the runs' checkpointer into a temporary directory."""
    tx = make_optimizer(OptimConfig())
    rng = np.random.default_rng(0)
    noise = lambda x: rng.standard_normal(x.shape, np.float32).astype(x.dtype) if jnp.issubdtype(
        x.dtype, jnp.floating) and x.ndim else x
    sizes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, params in states.items():
            ckpt = Checkpointer(Path(tmp) / name)
            state = {"params": params, "opt_state": tx.init(params), "step": jnp.int32(1)}
            ckpt.save(jax.tree.map(noise, state), {})
            ckpt.wait()
            ckpt.close()
            sizes[name] = checkpoint_bytes(Path(tmp) / name)
    return sizes


def quality(args: argparse.Namespace) -> None:
    """Full chat SFT and LoRA chat SFT from one base for the same steps: held-out exact match and checkpoint size."""
    out = Path(args.out)
    if any(Checkpointer(out / name).latest_step() is not None for name in ("full", "lora")):
        sys.exit(f"{args.out} already holds a run: give a new --out")
    base_minutes = trained(Path(args.base), "configs/stdlib_char.py", max_steps=args.base_steps,
                           **{"data.dir": args.data_dir})
    adapters = {"lora.rank": args.rank, "lora.targets": args.lora_targets}
    runs = {"full": {"optim.lr": args.lr, "optim.min_lr": args.lr / 10},
            "lora": {"optim.lr": args.lora_lr, "optim.min_lr": args.lora_lr / 10, **adapters}}
    if args.lora_save:
        runs["lora_save"] = {"optim.lr": args.lora_save_lr, "optim.min_lr": args.lora_save_lr / 10, **adapters,
                             "lora.modules_to_save": args.lora_save}
    results = {}
    for name, settings in runs.items():
        c = config("configs/chat_sft.py", workdir=str(out / name), init_from=f"workdir:{args.base}", cpu_devices=0,
                   max_steps=args.sft_steps, eval_interval=args.sft_steps, ckpt_interval=args.sft_steps,
                   batch_size=args.sft_batch, eval_batches=args.eval_batches, seed=args.seed,
                   **{"chat.datasets": args.datasets}, **settings)
        c.optim.warmup_steps = min(c.optim.warmup_steps, args.sft_steps // 10)
        t = time.perf_counter()
        metrics = train(from_config_dict(c), build)
        results[name] = {**metrics, "minutes": (time.perf_counter() - t) / 60, "bytes": checkpoint_bytes(out / name)}
    full = results["full"]
    print(f"\nbase: configs/stdlib_char.py, {args.base_steps} steps ({base_minutes:.1f} min, 0: there); chat SFT on "
          f"{args.datasets}: {args.sft_steps} steps of {args.sft_batch} rows, seed {args.seed}, "
          f"{full['val_conversations']} held-out conversations; {jax.devices()[0].device_kind}")
    print("| run | learning rate | held-out exact match | per dataset | val loss | checkpoint KiB | minutes |\n"
          "|---|---|---|---|---|---|---|")
    names = {"full": "full", "lora": f"LoRA rank {args.rank}", "lora_save": f"LoRA rank {args.rank} + {args.lora_save}"}
    for name, r in results.items():
        per = by_kind_text(r["val_exact_match_by_dataset"])
        print(f"| {names[name]} | {runs[name]['optim.lr']:g} | {r['val_exact_match']:.3f} | {per} | "
              f"{r['val_loss']:.4f} | {r['bytes'] / 1024:,.0f} | {r['minutes']:.1f} |")
    for name in results.keys() - {"full"}:
        ratio = results[name]["val_exact_match"] / max(full["val_exact_match"], 1e-9)
        size = results[name]["bytes"] / full["bytes"]
        print(f"targets, {names[name]}: exact match / full {ratio:.3f} >= 0.95 {'met' if ratio >= 0.95 else 'missed'}; "
              f"checkpoint / full {size:.3f} <= 0.05 {'met' if size <= 0.05 else 'missed'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--listed", action="store_true", help="listed layers (default: scanned, which compiles faster)")
    p.add_argument("--checkpoint_size", action="store_true", help="a full and a LoRA train state on disk (see above)")
    p.add_argument("--quality", action="store_true", help="full chat SFT vs LoRA chat SFT from one base (see above)")
    p.add_argument("--base", default="runs/stdlib_char", help="--quality: the base run (trained here if missing)")
    p.add_argument("--base_steps", type=int, default=150)
    p.add_argument("--data_dir", default="data/stdlib_char")
    p.add_argument("--out", default="/tmp/bench_lora", help="--quality: where the SFT runs go (must not hold them)")
    p.add_argument("--sft_steps", type=int, default=500)
    p.add_argument("--sft_batch", type=int, default=16)
    p.add_argument("--datasets", default="reverse", help="--quality: built-in chat datasets, comma-separated")
    p.add_argument("--lr", type=float, default=2e-3, help="--quality: full SFT's (configs/chat_sft.py's)")
    p.add_argument("--lora_lr", type=float, default=1e-2)
    p.add_argument("--lora_targets", default="", help="--quality: config.lora.targets ('': every block linear)")
    p.add_argument("--lora_save", default="wte,wpe,ln_*,bias",
                   help="--quality: config.lora.modules_to_save of a third run ('': none)")
    p.add_argument("--lora_save_lr", type=float, default=4e-3)
    p.add_argument("--seed", type=int, default=0, help="--quality: the SFT runs' seed")
    p.add_argument("--eval_batches", type=int, default=16)
    args = p.parse_args()
    if args.quality:
        return quality(args)
    if args.checkpoint_size:
        cfg = get_preset(args.preset).replace(scan_layers=not args.listed)
        found = lora.sites(abstract_variables(cfg)["params"], (), args.rank)
        sizes = checkpoint_sizes({"full": init_params(cfg, jax.random.key(0)),
                                  "lora": nn.unbox(lora.init_adapters(found, jax.random.key(1)))})
        ratio = sizes["lora"] / sizes["full"]
        print(f"{args.preset}, rank {args.rank} on every linear layer of the blocks: checkpoint on disk (params + "
              f"AdamW moments) full {sizes['full'] / 2 ** 20:,.1f} MiB, LoRA {sizes['lora'] / 2 ** 20:,.2f} MiB, "
              f"LoRA / full {ratio:.4f} ({ratio:.2%}) <= 0.05 {'met' if ratio <= 0.05 else 'missed'}")
        return None
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
