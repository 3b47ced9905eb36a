"""Initial parameters from elsewhere: a Hugging Face GPT-2 directory or another jaxgpt run.

`--config.init_from=hf:PATH` or `workdir:PATH` starts training (fine-tuning) from those weights
instead of a random init; the optimizer state starts fresh.
"""

from __future__ import annotations

from typing import Any

from jaxgpt.config import ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.model import stack_layers, unstack_layers

# Settings that change neither parameter shapes nor their meaning, so a fine-tuning run may set them freely.
RUNTIME_FIELDS = ("embd_dropout", "attn_dropout", "resid_dropout", "ff_dropout", "dtype", "param_dtype",
                  "attention_impl", "scan_layers", "remat", "init")


def load_initial_params(spec: str, cfg: ModelConfig) -> Any:
    """Parameters for `cfg` from `hf:PATH` or `workdir:PATH`, checked against `cfg`'s architecture."""
    kind, _, path = spec.partition(":")
    if kind == "hf" and path:
        from jaxgpt.hf import load_hf_gpt2

        params, source = load_hf_gpt2(path, block_size=cfg.block_size)
    elif kind == "workdir" and path:
        from jaxgpt.checkpoint import load_for_inference

        params, source, _ = load_for_inference(path)
    else:
        raise UserError(f"init_from={spec!r} is not understood: use hf:PATH (a Hugging Face GPT-2 directory) "
                        "or workdir:PATH (a jaxgpt work directory)")
    want, have = cfg.to_dict(), source.to_dict()
    diff = sorted(k for k in want if k not in RUNTIME_FIELDS and want[k] != have[k])
    if diff:
        shown = ", ".join(f"{k}: run {want[k]!r} vs weights {have[k]!r}" for k in diff)
        raise UserError(f"init_from {spec} has a different architecture ({shown}): set these model keys to "
                        "the weights' values")
    if source.scan_layers != cfg.scan_layers:
        params = stack_layers(params, cfg.n_layer) if cfg.scan_layers else unstack_layers(params, cfg.n_layer)
    return params
