"""A GPT-3-family 6.7B model (32 layers x 4096 wide, 32 heads, 2048 context) on an OpenWebText-style corpus.

For pod slices only: 2M tokens per step (1024 sequences of 2048) as in the GPT-3 paper, bf16 compute with
fp32 parameters and optimizer state (about 107 GB of state before sharding), layers scanned and fully
rematerialized, parameters and optimizer state sharded over every chip (FSDP). Check a slice first:
    jaxgpt aot --config configs/gpt_6.7b.py --topology v5p:4x4x8
(18.1 GiB per chip of 95, >= 1.89 s per step by the roofline bound; v6e:16x16 >= 0.58 s;
compiled with XLA attention and the dense loss).
See docs/scaling.md for the plan (which slice, mesh, batch and remat) and launch recipes.
The vocabulary is padded to 50304 (a multiple of 128) so it splits evenly over tensor-parallel devices.
"""

from jaxgpt.train.config import pod_config


def get_config():
    return pod_config("gpt-6.7b", "runs/gpt_6.7b", batch_size=1024, grad_accum=1,
                      max_steps=150_000, lr=1.2e-4, min_lr=1.2e-5, eval_batches=20)
