"""GPT-2 medium (350M parameters: 24 layers x 1024 wide, 16 heads) on an OpenWebText-style web corpus (GPT-2 BPE).

Sized for a TPU pod slice or a multi-node GPU cluster: about 0.5M tokens per step (512 sequences of 1024),
bf16 compute with fp32 parameters and optimizer state, layers scanned (compile time independent of depth)
and fully rematerialized (activations recomputed in the backward pass). Parameters and optimizer state are
sharded over all chips (FSDP); 4 micro-batches per step. Check a slice before paying for it, e.g.
    jaxgpt aot --config configs/gpt2_medium.py --topology v5e:4x4
(4.0 GiB per chip of 16, >= 0.90 s per step by the roofline bound, compiled with XLA attention and the dense loss).
On GPUs a scanned layer stack is a loop whose body the host launches every trip: on one GPU use
    --config.model.scan_layers=False --config.model.remat=none --config.mesh.fsdp=1 --config.batch_size=32
    --config.grad_accum=1
(42.3 GiB of an H100 by `jaxgpt aot --topology h100:1`; benchmarks/device_check.py's train_medium part trains it so).
See docs/scaling.md for the plan (which slice, mesh, batch and remat) and launch recipes.
The vocabulary is padded to 50304 (a multiple of 128) so it splits evenly over tensor-parallel devices.
"""

from jaxgpt.train.config import pod_config


def get_config():
    return pod_config("gpt2-medium", "runs/gpt2_medium", batch_size=512, grad_accum=4,
                      max_steps=300_000, lr=3e-4, min_lr=3e-05, eval_batches=50)
