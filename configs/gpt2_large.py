"""GPT-2 large (774M parameters: 36 layers x 1280 wide, 20 heads) on an OpenWebText-style web corpus (GPT-2 BPE).

Sized for a TPU pod slice or a multi-node GPU cluster: about 0.5M tokens per step (512 sequences of 1024),
bf16 compute with fp32 parameters and optimizer state, layers scanned (compile time independent of depth)
and fully rematerialized (activations recomputed in the backward pass). Parameters and optimizer state are
sharded over all chips (FSDP). Check a slice before paying for it, e.g.
    jaxgpt aot --config configs/gpt2_large.py --topology v5e:8x8
(4.5 GiB per chip of 16, >= 0.43 s per step by the roofline bound, compiled with XLA attention and the dense loss).
See docs/scaling.md for the plan (which slice, mesh, batch and remat) and launch recipes.
The vocabulary is padded to 50304 (a multiple of 128) so it splits evenly over tensor-parallel devices.
"""

from jaxgpt.train.config import pod_config


def get_config():
    return pod_config("gpt2-large", "runs/gpt2_large", batch_size=512, grad_accum=1,
                      max_steps=300_000, lr=2.5e-4, min_lr=2.5e-05, eval_batches=50)
