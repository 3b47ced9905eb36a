"""GPT-2 124M on FineWeb-Edu (GPT-2 BPE), nanoGPT's reproduction recipe.

The data is FineWeb-Edu's 10B-token sample, streamed and tokenized into data/fineweb_edu on first use (or
beforehand: `jaxgpt data --dataset fineweb_edu --out data/fineweb_edu`). Published llm.c / modded-nanogpt
shards train as they are: --config.data.name= --config.data.dir=PATH/TO/fineweb10B.

About 0.5M tokens per step (480 sequences of 1024), 600k steps; bf16 compute with fp32 parameters
and optimizer state; the platform's fused attention (`auto`: splash on TPU, cuDNN on GPU) and a loss
computed 128 positions at a time (the float32 logits of the whole batch never exist at once; on GPUs the chunks
are unrolled, so the step has no loop: `jaxgpt aot --topology h100:1` shows it).
On a pod, set the mesh, e.g. --config.mesh.data=-1 --config.mesh.fsdp=8.
The vocabulary is padded to 50304 (a multiple of 128) so it splits evenly over tensor-parallel devices.
"""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import base_config, model_fields, schedule


def get_config():
    c = base_config()
    c.workdir = "runs/gpt2_124m"
    c.data.name = "fineweb_edu"
    c.data.dir = "data/fineweb_edu"
    c.model = model_fields(
        get_preset("gpt2"), vocab_size=50304, dtype="bfloat16", param_dtype="float32", attention_impl="auto"
    )
    c.loss_chunk = 128
    c.batch_size = 480
    c.grad_accum = 8
    schedule(
        c,
        max_steps=600_000,
        lr=6e-4,
        min_lr=6e-5,
        warmup_steps=2000,
        weight_decay=0.1,
        b2=0.95,
        eval_interval=1000,
        eval_batches=100,
    )
    c.ckpt_interval = 1000
    c.log_interval = 10
    return c
