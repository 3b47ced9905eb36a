"""Qwen3 8B (8,190,735,360 parameters), continued pretraining on your text in its own tokenizer, on a pod slice.

The model is the `qwen3-8b` preset (its published config.json); start from the weights with
--config.init_from=hf:PATH/TO/Qwen3-8B (the config then agrees with them key for key). The data is your text
tokenized by the model's tokenizer:
    jaxgpt data --text my.txt --tokenizer_from hf:PATH/TO/Qwen3-8B --out data/qwen3_text
About 2M tokens per step (1024 sequences of 2048 in 64 micro-batches: on v5e:4x4 one row of 4096 per chip
needs 19.6 GiB, of 8192 25.5), bf16 compute with fp32 parameters and AdamW state (128 GB before sharding), layers
scanned and fully rematerialized, everything sharded over every chip (FSDP), the platform's fused attention and a
chunked loss.
Check a slice first:
    jaxgpt aot --config configs/qwen3_8b.py --topology v5e:4x4
    jaxgpt aot --config configs/qwen3_8b.py --topology h100:8
(docs/scaling.md#open-weight-models-llama-31-8b-and-qwen3-8b has what they print).
"""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import pod_config


def get_config():
    c = pod_config("qwen3-8b", "runs/qwen3_8b", batch_size=1024, grad_accum=64, max_steps=2000, lr=3e-5,
                   min_lr=3e-6, eval_batches=20, vocab_size=get_preset("qwen3-8b").vocab_size)
    c.model.block_size = 2048
    c.data.name, c.data.dir = "", "data/qwen3_text"
    return c
