"""GPT-2 XL (1.5B parameters: 48 layers x 1600 wide, 25 heads) on an OpenWebText-style web corpus (GPT-2 BPE).

Sized for a TPU pod slice or a multi-node GPU cluster: about 0.5M tokens per step (512 sequences of 1024),
bf16 compute with fp32 parameters and optimizer state, layers scanned (compile time independent of depth)
and fully rematerialized (activations recomputed in the backward pass). Parameters and optimizer state are
sharded over all chips (FSDP). Check a slice before paying for it:
    jaxgpt aot --config configs/gpt2_xl.py --topology v5p:4x4x4
(5.7 GiB per chip of 95, >= 244 ms per step by the roofline bound; with --config.model.remat=save_dots
16.3 GiB and >= 223 ms, the better choice on v5p; v5e:8x8 needs full remat; compiled with XLA attention
and the dense loss).
See docs/scaling.md for the plan (which slice, mesh, batch and remat) and launch recipes.
The vocabulary is padded to 50304 (a multiple of 128) so it splits evenly over tensor-parallel devices.
"""

from jaxgpt.train.config import pod_config


def get_config():
    return pod_config("gpt2-xl", "runs/gpt2_xl", batch_size=512, grad_accum=1,
                      max_steps=300_000, lr=2e-4, min_lr=2e-5, eval_batches=50)
