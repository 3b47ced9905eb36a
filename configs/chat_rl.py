"""RL after SFT: GRPO on the built-in arithmetic, reverse and fact prompts, rewarded for the exact answer (no download).

Continues runs/chat_sft (configs/chat_sft.py; train it first) with task rl (jaxgpt/tasks/rl.py): each step samples 8
completions for each of 32 training prompts through the serving engine, rewards each 1 when it equals the answer and
0 otherwise, normalizes the rewards within each prompt's group and takes a clipped policy-gradient step on the
completion tokens (GRPO's per-completion mean, so a 2-character sum weighs as much as a 6-letter word; no KL penalty,
as current practice). Their replies are at most 6 characters: 8 new tokens. Held-out prompts are split by SFT's hash
of the prompt: a prompt SFT held out is held out here.

A completion cut at the 8 tokens (no end token) takes no part in the loss (rl.mask_truncated_completions), so cut
rambles do not teach every task to stop sooner.

Measured (benchmarks/bench_rl.py, docs/rl.md "Measured", 2026-11-28; 15.5 minutes of RL) from a 200-step SFT run,
greedy pass@1 on 500 held-out prompts each: reverse 0.680 -> 0.916, fact 0.484 -> 0.586, arithmetic 0.116 -> 0.160,
and count, which it does not train on, 0.148 -> 0.056. A KL penalty to the SFT model holds count (rl.beta=0.3: 0.148
-> 0.152) at some of reverse's gain (+0.194), and arithmetic then loses one of its 30 distinct held-out prompts
(they repeat 6 to 31 times in the 500: 0.116 -> 0.060); the reference pass also slows the rollouts (0.62x the
engine, against 1.02x). Every evaluation samples 256 held-out prompts: pass@1 of the greedy reply, pass@8 and pass@1
of sampled ones, and scores the loss of their reference answers.

    python train.py --config configs/chat_rl.py [--config.init_from=workdir:runs/chat_sft]
    python sample.py --workdir runs/chat_rl --chat          # or jaxgpt serve --workdir runs/chat_rl

Your own reward: --config.rl.reward=my_rewards:brevity (a function of (prompt messages, completion text) -> float,
docs/rl.md), several with weights: --config.rl.reward=exact=1,my_rewards:brevity=0.1. Your own prompts:
--config.chat.data=prompts.jsonl ({"messages": [...], "answer": "..."} per line).
benchmarks/bench_rl.py measures what this gains over the SFT model it starts from, on every built-in task
(docs/rl.md, "Measured").
"""

from jaxgpt.train.config import base_config, schedule


def get_config():
    c = base_config()
    c.task = "rl"
    c.workdir = "runs/chat_rl"
    c.init_from = "workdir:runs/chat_sft"
    c.chat.data = "builtin"
    c.chat.tasks = "arithmetic,reverse,fact"
    c.chat.examples = 20000
    c.chat.val_fraction = 0.05
    c.rl.reward = "exact"
    c.rl.num_generations = 8
    c.rl.max_new_tokens = 8
    c.rl.loss_type = "grpo"
    c.rl.mask_truncated_completions = True
    c.rl.eval_prompts = 256
    c.rl.pass_k = 8
    c.batch_size = 256  # completions: 32 prompts x 8 (fewer prompts per step gave noisier, slower gains)
    # lr: 2e-4 lowered every task's held-out pass@1 within 60 steps; 5e-5 raised reverse and fact
    schedule(c, max_steps=300, lr=5e-5, min_lr=2.5e-5, warmup_steps=10, weight_decay=0.0, b2=0.99, eval_interval=100)
    c.ckpt_interval = 100
    c.keep_checkpoints = 1
    return c
