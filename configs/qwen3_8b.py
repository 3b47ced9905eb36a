"""Qwen3 8B (8,190,735,360 parameters), continued pretraining on your text in its own tokenizer, on a pod slice.

The model is the `qwen3-8b` preset (its published config.json); start from the weights with
--config.init_from=hf:PATH/TO/Qwen3-8B (the config then agrees with them key for key). The data is your text
tokenized by the model's tokenizer:
    jaxgpt data --text my.txt --tokenizer_from hf:PATH/TO/Qwen3-8B --out data/qwen3_text
About 2M tokens per step (512 sequences of 4096 in 32 micro-batches: one 8192-token row per v5e chip needs 25.5
GiB), bf16 compute with fp32 parameters and AdamW state (128 GB before sharding), layers scanned and fully
rematerialized, everything sharded over every chip (FSDP), the platform's fused attention and a chunked loss.
Check a slice first:
    jaxgpt aot --config configs/qwen3_8b.py --topology v5e:4x4
    jaxgpt aot --config configs/qwen3_8b.py --topology h100:8
(docs/scaling.md#open-weight-models-llama-31-8b-and-qwen3-8b has what they print).
"""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import pod_config


def get_config():
    c = pod_config("qwen3-8b", "runs/qwen3_8b", batch_size=512, grad_accum=32, max_steps=2000, lr=3e-5,
                   min_lr=3e-6, eval_batches=20, vocab_size=get_preset("qwen3-8b").vocab_size)
    c.model.block_size = 4096
    c.data.name, c.data.dir = "", "data/qwen3_text"
    return c
