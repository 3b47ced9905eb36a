"""GPT-2 large (774M parameters: 36 layers x 1280 wide, 20 heads) on an OpenWebText-style web corpus (GPT-2 BPE).

Sized for a TPU pod slice or a multi-node GPU cluster: about 0.5M tokens per step (512 sequences of 1024),
bf16 compute with fp32 parameters and optimizer state, layers scanned (compile time independent of depth)
and fully rematerialized (activations recomputed in the backward pass). Parameters and optimizer state are
sharded over all chips (FSDP). Check a slice before paying for it, e.g.
    python -m jaxgpt.aot --config configs/gpt2_large.py --topology v5e:8x8
(4.5 GiB per chip of 16, >= 0.43 s per step by the roofline bound).
See docs/scaling.md for the plan (which slice, mesh, batch and remat) and launch recipes.
The vocabulary is padded to 50304 (a multiple of 128) so it splits evenly over tensor-parallel devices.
"""

from jaxgpt.presets import get_preset
from jaxgpt.train_config import base_config, model_fields


def get_config():
    c = base_config()
    c.workdir = "runs/gpt2_large"
    c.data.name = "openwebtext"
    c.data.dir = "data/openwebtext"
    c.model = model_fields(get_preset("gpt2-large"), vocab_size=50304, dtype="bfloat16", param_dtype="float32",
                           attention_impl="xla", scan_layers=True, remat="full")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.batch_size = 512
    c.grad_accum = 1
    c.max_steps = 300_000
    c.optim.lr = 2.5e-4
    c.optim.min_lr = 2.5e-05
    c.optim.warmup_steps = 2000
    c.optim.weight_decay = 0.1
    c.optim.b2 = 0.95
    c.eval_interval = 1000
    c.eval_batches = 50
    c.ckpt_interval = 1000
    c.log_interval = 10
    return c
