"""nanochat's d12 model on FineWeb-Edu (GPT-2 BPE), with nanochat's recipe: Muon, then a linear warm-down.

The "nanochat-d12" preset (12 layers, 768 wide, 6 heads of 128, 2048 tokens of context; rotary, QK-norm, ReLU^2,
no biases, parameter-free RMSNorm, untied head, logits soft-capped at 15) with the GPT-2 vocabulary padded to
50304 instead of nanochat's own 65536-token one, so that FineWeb-Edu's GPT-2 shards train as they are (data as in
configs/gpt2_124m.py). About 0.5M tokens per step (256 sequences of 2048); 7,000 steps are about 3.7B tokens,
20 per parameter. Muon (0.02) for the hidden matrices, AdamW (4e-3, no weight decay) for the embedding and
head; the rate is held after a short warmup and falls linearly to 0 over the last 20% of the steps.
bf16 compute with fp32 parameters and optimizer state, the platform's fused attention and a chunked loss.
"""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import base_config, model_fields, schedule


def get_config():
    c = base_config()
    c.workdir = "runs/nanochat_d12"
    c.data.name = "fineweb_edu"
    c.data.dir = "data/fineweb_edu"
    c.model = model_fields(get_preset("nanochat-d12"), vocab_size=50304, dtype="bfloat16", param_dtype="float32",
                           attention_impl="auto")
    c.loss_chunk = 128
    c.batch_size = 256
    c.grad_accum = 8
    schedule(c, max_steps=7000, lr=4e-3, min_lr=0.0, warmup_steps=100, weight_decay=0.0, b2=0.95,
             eval_interval=500, eval_batches=50)
    c.optim.update({"optimizer": "muon", "muon_lr": 0.02, "schedule": "wsd", "cooldown_fraction": 0.2,
                    "cooldown_shape": "linear"})
    c.ckpt_interval = 500
    c.log_interval = 10
    return c
