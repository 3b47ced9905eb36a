"""Chat fine-tuning quick start: teach the quick-start character model to answer in turns (no download).

Fine-tunes the model of configs/stdlib_char.py (train it first: `python train.py --config configs/stdlib_char.py`)
on built-in conversations with one right answer each: adding or subtracting numbers up to 49, spelling a random
3-6-letter string backwards, counting a letter in one, and answering from a fact about a random name stated in the
system message. Held-out conversations are split by prompt, so they are new strings, names and operand pairs:
exact match on them measures the skills, not recall. The chat format's special tokens are added to the character
vocabulary; the loss covers the assistant's tokens only; held-out exact match is reported per task at every
evaluation. The run's chat template is saved as runs/chat_sft/chat_template.jinja.

    python train.py --config configs/chat_sft.py [--config.init_from=workdir:runs/stdlib_char]

Your own conversations (OpenAI's {"messages": [...]} per line): --config.chat.data=path/to/chat.jsonl. Training
rows hold several conversations each (chat.pack, 1.59 per row on these, against 42% padding with one per row:
benchmarks/bench_chat_packing.py compares the two); --config.chat.pack=False keeps one per row.

Measured 2026-11-28 from the 700-step base run: the base model scores 0.00 on every task. On the shared 2-core
machine (27 minutes, an RL run beside it) held-out exact match was 0.50 at step 500, 0.80 at 1000, 0.95 at 1500 and
0.988 at 2000 (arithmetic 0.96, count 1.00, fact 1.00, reverse 1.00); through `jaxgpt serve`'s /v1/chat/completions
(benchmarks/bench_chat.py, all 1026 held-out conversations) 0.982 (arithmetic 0.941). With operands up to 19 (before
2026-11-28) it was 0.992 at 2000 steps and 0.996 through the server, and one conversation per row reached 0.88 at
1500 and 0.986 at 2000 steps (28 minutes; 0.984 through the server). Count answers count aloud ("b0 a1 n1 a2 n2 a3:
3"); with the bare total the same model stayed near chance (docs/chat.md).
"""

from jaxgpt.train.config import base_config, schedule


def get_config():
    c = base_config()
    c.task = "chat"
    c.workdir = "runs/chat_sft"
    c.init_from = "workdir:runs/stdlib_char"
    c.chat.data = "builtin"
    c.chat.examples = 20000
    c.chat.val_fraction = 0.05
    c.chat.pack = True
    c.batch_size = 64
    c.cpu_devices = 2  # as the base run: two data-parallel XLA devices on a CPU host
    schedule(c, max_steps=2000, lr=2e-3, min_lr=2e-4, warmup_steps=50, weight_decay=0.0, b2=0.99, eval_interval=500,
             eval_batches=8)
    c.ckpt_interval = 500
    c.keep_checkpoints = 1
    return c
