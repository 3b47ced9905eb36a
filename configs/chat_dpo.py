"""Preference tuning after SFT: DPO on pairs made from the four built-in datasets (no download).

Continues runs/chat_sft (configs/chat_sft.py; train it first) with task dpo (jaxgpt/tasks/dpo/): each pair is a
built-in prompt with its right answer (chosen) and a wrong one close to it (rejected: a number off by one or two,
one letter changed), held out by SFT's hash of the prompt, so a prompt SFT held out is held out here. The loss is
ORPO's (lambda 1.0, lr 1e-3: the best of the recipes measured in docs/dpo.md#measuring-it, where DPO's sigmoid loss
let the chosen rewards fall), reference-free: the chosen reply's NLL and an odds-ratio term, so no reference
log-probabilities are computed. DPO itself: --config.dpo.loss_type=sigmoid (the SFT model's log-probabilities of every
pair computed once before the first step and kept in runs/chat_dpo/reference_logps.npz), with
--config.dpo.rpo_alpha=1.0 to hold the chosen replies up. Evaluations report TRL's reward metrics on held-out pairs
and the held-out exact match of the right answers per dataset.

    python train.py --config configs/chat_dpo.py [--config.init_from=workdir:runs/chat_sft]
    python sample.py --workdir runs/chat_dpo --chat          # or jaxgpt serve --workdir runs/chat_dpo

Your own pairs, TRL's format ({"prompt", "chosen", "rejected"} per line, text or messages):
--config.dpo.data=pairs.jsonl (or a Hub dataset, hf:NAME); other losses: --config.dpo.loss_type=sigmoid (ipo, hinge,
simpo).
benchmarks/bench_dpo.py measures the SFT model against the DPO model on held-out pairs and prompts, over 3 seeds.
"""

from jaxgpt.train.config import base_config, schedule


def get_config():
    c = base_config()
    c.task = "dpo"
    c.workdir = "runs/chat_dpo"
    c.init_from = "workdir:runs/chat_sft"
    c.dpo.data = "builtin"
    c.dpo.datasets = "arithmetic,reverse,count,fact"
    c.dpo.examples = 20000
    c.dpo.val_fraction = 0.05
    c.dpo.loss_type = "orpo"  # the best measured (docs/dpo.md#measuring-it): DPO's sigmoid let the chosen rewards fall
    c.dpo.orpo_lambda = 1.0
    c.dpo.beta = 0.1
    c.batch_size = 64  # pairs: 128 sequences a step
    c.cpu_devices = 2
    schedule(c, max_steps=300, lr=1e-3, min_lr=1e-4, warmup_steps=10, weight_decay=0.0, b2=0.99, eval_interval=100,
             eval_batches=4)
    c.ckpt_interval = 100
    c.keep_checkpoints = 1
    return c
