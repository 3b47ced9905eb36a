"""A GPT-3-family 6.7B model (32 layers x 4096 wide, 32 heads, 2048 context) on an OpenWebText-style corpus.

For pod slices only: 2M tokens per step (1024 sequences of 2048) as in the GPT-3 paper, bf16 compute with
fp32 parameters and optimizer state (about 107 GB of state before sharding), layers scanned and fully
rematerialized, parameters and optimizer state sharded over every chip (FSDP). Check a slice first:
    python -m jaxgpt.aot --config configs/gpt_6.7b.py --topology v5p:4x4x8
(18.1 GiB per chip of 95, >= 1.89 s per step by the roofline bound; v6e:16x16 >= 0.58 s).
See docs/scaling.md for the plan (which slice, mesh, batch and remat) and launch recipes.
The vocabulary is padded to 50304 (a multiple of 128) so it splits evenly over tensor-parallel devices.
"""

from jaxgpt.presets import get_preset
from jaxgpt.train_config import base_config, model_fields


def get_config():
    c = base_config()
    c.workdir = "runs/gpt_6.7b"
    c.data.name = "openwebtext"
    c.data.dir = "data/openwebtext"
    c.model = model_fields(get_preset("gpt-6.7b"), vocab_size=50304, dtype="bfloat16", param_dtype="float32",
                           attention_impl="xla", scan_layers=True, remat="full")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.batch_size = 1024
    c.grad_accum = 1
    c.max_steps = 150_000
    c.optim.lr = 1.2e-4
    c.optim.min_lr = 1.2e-5
    c.optim.warmup_steps = 2000
    c.optim.weight_decay = 0.1
    c.optim.b2 = 0.95
    c.eval_interval = 1000
    c.eval_batches = 20
    c.ckpt_interval = 1000
    c.log_interval = 10
    return c
