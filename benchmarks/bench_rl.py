"""RL after SFT, measured: held-out pass@1 of the SFT model and of the RL models it becomes, for 3 seeds from the same
SFT start, on every built-in dataset, and the rollouts' speed against the engine's own on the same requests, in one run.

    python benchmarks/bench_rl.py                              # base and early SFT runs trained here if missing
    python benchmarks/bench_rl.py --sft runs/chat_sft --out /tmp/bench_rl --rl_steps 200 --seeds 0
    python benchmarks/bench_rl.py --config my_rl.py            # another RL configuration

The RL runs are configs/chat_rl.py or --config (GRPO on built-in prompts, exact-answer reward) from an SFT model that
leaves room: the quick start's base model (configs/stdlib_char.py, trained into --base if it holds no run)
fine-tuned by configs/chat_sft.py for only a few steps, where the full 2000 leave almost nothing to gain. Unless
--sft holds a run, the start is chosen by its score: an SFT run for each of --sft_steps (150, 160, 170, 180 steps,
into --sft/stepsN, each trained if missing), the one whose best RL dataset's held-out exact match (its own final
evaluation) comes closest to 0.65 (`sft_start`). From about 0.5 RL finds too few right samples to learn from, from
about 0.8 the target task is near its pass@8 already, and how many steps reach 0.65 depends on the base run and
the machine (docs/rl.md "Measured"). The SFT model and each RL model answer the distinct held-out
prompts of each built-in dataset (those the SFT split holds out, up to --prompts per task): pass@1 of the greedy
reply, pass@8 and pass@1 of 8 replies sampled at temperature 1. The task the gain is measured on (--target) is, unless
named, the one of those RL trains on where the SFT model leaves the most room (its pass@8 less its sampled pass@1:
what sampling finds but does not find reliably yet), chosen once from the SFT model's scores alone. Each seed of
--seeds (config.seed: its own training prompts, rollouts and batches; the held-out prompts are the same) is one RL
run into --out/seed{N}, timed whole (rollouts, updates, evaluations) and scored as the SFT model was; a table per seed
as it finishes, then each seed's changes, their mean and minimum. The targets, over the seeds: the target task's
greedy pass@1 up by 0.15 or more on the mean and by 0.10 or more on the worst seed, no other task's mean change below
-0.02, all the seeds' RL within 45 minutes together.

Rollout speed: one RL step's rollouts as the task samples them (`RL.rollouts`: the engine's decoding, then the
rewards, the advantages and the rows, and the reference log-probabilities when the config's rl.beta > 0) against
`generate_many` alone on the same requests (prompts, seeds, lengths), --rounds times each in turn, new tokens per
second of each (target: the task at 0.8x the engine or better).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
from ml_collections import ConfigDict

from jaxgpt.commands import load_config_file
from jaxgpt.data.conversations import BUILTIN_DATASETS
from jaxgpt.generate.many import generate_many
from jaxgpt.io import weights
from jaxgpt.io.checkpoint import Checkpointer
from jaxgpt.model.config import comma_names
from jaxgpt.tasks import build
from jaxgpt.tasks.rl.prompts import Prompt, load_prompts, split_prompts
from jaxgpt.tasks.rl.rewards import parse_rewards
from jaxgpt.tasks.rl.rollouts import PromptSet, Sampler, encode_prompts, pass_rates
from jaxgpt.tasks.rl.task import local_weights
from jaxgpt.tools.plots import read_metrics
from jaxgpt.train.config import RLConfig, from_config_dict
from jaxgpt.train.loop import train

K = 8  # pass@K for the RL task
ROOT = Path(__file__).resolve().parents[1]


def config(path: str, **overrides: object) -> ConfigDict:
    c = load_config_file(path, path)
    c.update_from_flattened_dict(overrides)
    return c


def int_list(text: str) -> list[int]:
    """--seeds: comma-separated integers, e.g. 0,1,2 (argparse's `type`, shared by the post-training benchmarks)."""
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 0,1,2") from None


START = 0.65  # the SFT start's held-out exact match on its best RL dataset (docs/rl.md "Measured": the most gained)


def sft_start(args: argparse.Namespace, datasets: list[str]) -> tuple[Path, float, str]:
    """The SFT run RL starts from, the minutes spent training it and a line saying why: --sft when it holds a run,
    else configs/chat_sft.py from --base for each of --sft_steps steps (into --sft/stepsN, each trained if missing),
    the one whose best dataset of `datasets` comes closest to START in its final held-out exact match. A short SFT's
    score climbs 0.2 in 25 steps, and how far a number of steps goes depends on the base run and on the machine's
    arithmetic (the 175 steps that gave 0.650 on 2026-11-28 gave 0.822 a day later from another base run): the score
    carries from one machine to another, the count of steps does not."""
    if Checkpointer(args.sft).latest_step() is not None:
        return Path(args.sft), 0.0, f"{args.sft} (given)"
    minutes, best = 0.0, {}
    for n in args.sft_steps:
        run = Path(args.sft) / f"steps{n}"
        minutes += trained(run, "configs/chat_sft.py", max_steps=n, init_from=f"workdir:{args.base}",
                           eval_interval=n)
        final = [r for r in read_metrics(run) if "val_loss" in r][-1]
        best[n] = max(final[f"val_exact_match_by_dataset/{d}"] for d in datasets
                      if f"val_exact_match_by_dataset/{d}" in final)
    n = min(best, key=lambda k: abs(best[k] - START))
    return (Path(args.sft) / f"steps{n}", minutes, f"{n} steps: its best dataset's held-out exact match {best[n]:.2f}, "
            f"the closest to {START} of " + ", ".join(f"{k} steps {v:.2f}" for k, v in best.items()))


def trained(workdir: Path, config_file: str, **overrides: object) -> float:
    """Run train.py on `config_file` with `overrides` into `workdir` unless it already holds a run; the minutes it
    took (0 when it was there). A process of its own: those runs choose their CPU devices before JAX starts, and
    JAX has started in this one."""
    if Checkpointer(workdir).latest_step() is not None:
        return 0.0
    t = time.perf_counter()
    flags = [f"--config.{key}={value}" for key, value in {"workdir": workdir, **overrides}.items()]
    subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / config_file), *flags], check=True)
    return (time.perf_counter() - t) / 60


def held_out(task: str, n: int, tokenizer, block_size: int) -> PromptSet:
    """Up to `n` distinct held-out prompts of a built-in dataset (SFT's split: a hash of the prompt). Each counts
    once: drawn with repeats, a prompt of a task with few distinct ones weighs more than others (with operands up
    to 19 arithmetic held out 30, one of them up to 31 times in 500, and moved pass@1 by 0.06 alone)."""
    prompts, _ = load_prompts(RLConfig(datasets=task, examples=40 * n), seed=0)
    distinct: dict[str, Prompt] = {}
    for p in split_prompts(prompts, 0.05)[1]:
        distinct.setdefault(json.dumps(p.messages, sort_keys=True), p)
    held, _ = encode_prompts(list(distinct.values())[:n], tokenizer, block_size, 48)
    return held


def scores(workdir: Path, tasks: tuple[str, ...], n: int, slots: int) -> dict[str, dict]:
    """Greedy pass@1, pass@K and sampled pass@1 of the run's latest checkpoint on each task's held-out prompts."""
    loaded = weights.load(f"workdir:{workdir}")
    tokenizer = loaded.tokenizer()
    sampler = Sampler(loaded.model, tokenizer, loaded.meta["chat"]["end_id"], RLConfig(slots=slots),
                      parse_rewards("exact"))
    return {task: pass_rates(sampler, loaded.params, held_out(task, n, tokenizer, loaded.model.block_size), K, seed=0)
            for task in tasks}


def rollout_speed(c: ConfigDict, rounds: int) -> dict[str, float]:
    """New tokens/s of one step's rollouts through the task and through `generate_many` alone, taking turns."""
    task = build(from_config_dict(c))
    params = local_weights(task.pretrained())
    task.use_weights(params)
    P = task.cfg.batch_size // task.rl.num_generations
    order, seeds = task.requests(0, range(P))
    task.rollouts(0, range(P))  # compile both paths once
    times: dict[str, list[float]] = {"task": [], "engine": []}
    for _ in range(rounds):
        t = time.perf_counter()
        tokens = int(task.rollouts(0, range(P))["completion_tokens"].sum())
        times["task"].append(time.perf_counter() - t)
        t = time.perf_counter()
        out = generate_many(params, task.model_cfg, [task.train.ids[i] for i in order],
                            max_new_tokens=[task.train.room[i] for i in order], seeds=seeds,
                            temperature=task.rl.temperature, top_p=task.rl.top_p, eot_token=task.end_id,
                            vocab_limit=task.tokenizer.vocab_size, slots=task.rl.slots)
        times["engine"].append(time.perf_counter() - t)
        assert sum(map(len, out)) == tokens, "the task's rollouts are the engine's"
    task_s, engine_s = statistics.median(times["task"]), statistics.median(times["engine"])
    return {"new tokens per step": tokens, "task tok/s": tokens / task_s, "engine tok/s": tokens / engine_s,
            "task / engine": engine_s / task_s}


def task_table(before: dict, after: dict, target: str) -> None:
    """One seed's scores against the SFT model's, a row per built-in dataset."""
    print(f"| task (held-out prompts) | SFT pass@1 | RL pass@1 | change | SFT sampled pass@1 | RL sampled pass@1 | "
          f"SFT pass@{K} | RL pass@{K} |\n|---|---|---|---|---|---|---|---|")
    for task in BUILTIN_DATASETS:
        b, a = before[task], after[task]
        print(f"| {task}{' (target)' if task == target else ''} ({b['val_prompts']}) | {b['val_pass_at_1']:.3f} | "
              f"{a['val_pass_at_1']:.3f} | {a['val_pass_at_1'] - b['val_pass_at_1']:+.3f} | "
              f"{b['val_sampled_pass_at_1']:.3f} | {a['val_sampled_pass_at_1']:.3f} | {b['val_pass_at_k']:.3f} | "
              f"{a['val_pass_at_k']:.3f} |")


def summarize(before: dict, after: dict[int, dict], rl_minutes: dict[int, float], target: str, steps: int) -> None:
    """Each seed's change in greedy pass@1 per task, their mean and minimum over the seeds, and the targets."""
    total = sum(rl_minutes.values())
    change = {s: {t: after[s][t]["val_pass_at_1"] - before[t]["val_pass_at_1"] for t in BUILTIN_DATASETS}
              for s in after}
    order = [target, *(t for t in BUILTIN_DATASETS if t != target)]
    sft = ", ".join(f"{t} {before[t]['val_pass_at_1']:.3f}" for t in order)
    print(f"\nchange in greedy pass@1 over the SFT model ({sft}):\n")
    print("| seed | RL minutes | " + " | ".join(f"{t}{' (target)' if t == target else ''}" for t in order)
          + " |\n|---|---|" + "---|" * len(order))
    for s in after:
        print(f"| {s} | {rl_minutes[s]:.1f} | " + " | ".join(f"{change[s][t]:+.3f}" for t in order) + " |")
    for name, reduce, took in (("mean", statistics.mean, f"{statistics.mean(rl_minutes.values()):.1f}"),
                               ("min", min, "")):
        print(f"| {name} | {took} | "
              + " | ".join(f"{reduce(change[s][t] for s in after):+.3f}" for t in order) + " |")
    gains = [change[s][target] for s in after]
    others = {t: statistics.mean(change[s][t] for s in after) for t in BUILTIN_DATASETS if t != target}
    worst = min(others, key=others.get)
    print(f"\nRL {total:.1f} minutes for {len(after)} seeds of {steps} steps (evaluations included)")
    print(f"targets ({len(after)} seeds): {target} pass@1 mean {statistics.mean(gains):+.3f} >= +0.15 "
          f"{'met' if statistics.mean(gains) >= 0.15 else 'missed'}; worst seed {min(gains):+.3f} >= +0.10 "
          f"{'met' if min(gains) >= 0.10 else 'missed'}; other tasks' worst mean change {others[worst]:+.3f} "
          f"({worst}) >= -0.02 {'met' if others[worst] >= -0.02 else 'missed'}; RL {total:.1f} minutes <= 45 "
          f"{'met' if total <= 45 else 'missed'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/chat_rl.py", help="the RL runs' configuration file")
    parser.add_argument("--base", default="runs/stdlib_char")
    parser.add_argument("--sft", default="runs/chat_sft_early",
                        help="the SFT run to start from, or where the runs of --sft_steps go (stepsN each)")
    parser.add_argument("--sft_steps", type=int_list, default="150,160,170,180",
                        help="the SFT runs' lengths to choose the start from (sft_start)")
    parser.add_argument("--out", default="/tmp/bench_rl", help="where the RL runs go: seedN each (must not hold them)")
    parser.add_argument("--seeds", type=int_list, default="0,1,2",
                        help="one RL run per seed, each from the same SFT model")
    parser.add_argument("--rl_steps", type=int, default=0, help="0: configs/chat_rl.py's max_steps")
    parser.add_argument("--prompts", type=int, default=500, help="the most distinct held-out prompts per task")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data_dir", default="data/stdlib_char")
    parser.add_argument("--target", default="", choices=("", *BUILTIN_DATASETS),
                        help="the task the gain is measured on (default: where the SFT model leaves the most room)")
    args = parser.parse_args()
    seeds, out = args.seeds, Path(args.out)
    if any(Checkpointer(out / f"seed{s}").latest_step() is not None for s in seeds):
        parser.error(f"{args.out} already holds a run: give a new --out")
    rl = config(args.config, seed=seeds[0], workdir=str(out / f"seed{seeds[0]}"), **{"rl.slots": args.slots})
    rl.max_steps = args.rl_steps or rl.max_steps
    trained_on = comma_names(rl.rl.datasets)
    minutes = {"base": trained(Path(args.base), "configs/stdlib_char.py", **{"data.dir": args.data_dir})}
    sft, minutes["sft"], chosen = sft_start(args, trained_on)
    rl.init_from = f"workdir:{sft}"
    before = scores(sft, BUILTIN_DATASETS, args.prompts, args.slots)
    room = {t: before[t]["val_pass_at_k"] - before[t]["val_sampled_pass_at_1"] for t in trained_on}
    target = args.target or max(room, key=room.get)
    speed = rollout_speed(rl, args.rounds)  # once: the seed changes which prompts are sampled, not how fast
    print(f"\nminutes: base {minutes['base']:.1f}, SFT {minutes['sft']:.1f} (0: there)\nSFT start: {chosen}")
    why = "named" if args.target else f"the most room, pass@{K} - sampled pass@1: " + ", ".join(f"{t} {r:.3f}"
                                                                                  for t, r in room.items())
    print(f"target {target} ({why})")
    print(f"rollouts: {json.dumps({k: round(v, 3) for k, v in speed.items()})} (target task / engine >= 0.8: "
          f"{'met' if speed['task / engine'] >= 0.8 else 'missed'}); devices: {jax.devices()[0].device_kind}")
    after, rl_minutes = {}, {}
    for s in seeds:  # each seed's table as soon as it is in: a run cut short keeps what it measured
        rl.seed, rl.workdir = s, str(out / f"seed{s}")
        t = time.perf_counter()
        train(from_config_dict(rl), build)
        rl_minutes[s] = (time.perf_counter() - t) / 60
        after[s] = scores(Path(rl.workdir), BUILTIN_DATASETS, args.prompts, args.slots)
        print(f"\nseed {s}: RL {rl_minutes[s]:.1f} minutes ({rl.max_steps} steps, evaluations included)\n")
        task_table(before, after[s], target)
    summarize(before, after, rl_minutes, target, rl.max_steps)


if __name__ == "__main__":
    main()
