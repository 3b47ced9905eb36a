"""The one weight loader: `load(source)` -> parameters, their model config and their tokenizer.

Sources, everywhere a command takes weights (sampling, fine-tuning, `init_from`, plots, export):

* `workdir:PATH`: a jaxgpt run's latest (or best) checkpoint; its meta names the model and tokenizer.
* `hf:PATH`: a Hugging Face GPT-2 directory (`save_pretrained` layout, `jaxgpt.hf`).
* `preset:NAME`: a randomly initialized preset (`jaxgpt.presets`): the pipeline without training.

A source without a tokenizer of its own gets GPT-2's BPE when its vocabulary is GPT-2's, and none otherwise
(`Weights.tokenizer` then says so).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax

from jaxgpt.checkpoint import open_checkpoint
from jaxgpt.config import RUNTIME_FIELDS, ModelConfig, model_config_from_dict
from jaxgpt.errors import UserError
from jaxgpt.model import init_params, stack_layers, unstack_layers
from jaxgpt.presets import get_preset
from jaxgpt.tokenizer import GPT2_TOKENIZER_META, GPT2_VOCAB_SIZE, Tokenizer, tokenizer_from_meta

SOURCES = "workdir:PATH (a jaxgpt run), hf:PATH (a Hugging Face GPT-2 directory) or preset:NAME"


@dataclasses.dataclass(frozen=True, eq=False)
class Weights:
    """Loaded weights: plain (unboxed) parameters on the default device, and what they mean."""

    params: Any
    model: ModelConfig
    tokenizer_meta: dict[str, Any] | None  # `Tokenizer.to_meta()`, or None when no tokenizer is known
    meta: dict[str, Any]  # the checkpoint's meta for workdir: sources; {} otherwise
    description: str

    def tokenizer(self, bpe_file: str | os.PathLike[str] | None = None) -> Tokenizer:
        if self.tokenizer_meta is None:
            raise UserError(f"{self.description} has a {self.model.vocab_size}-token vocabulary and no tokenizer: "
                            f"jaxgpt knows GPT-2's ({GPT2_VOCAB_SIZE} tokens) and those saved with jaxgpt runs")
        return tokenizer_from_meta(self.tokenizer_meta, bpe_file)


def _vocabulary_tokenizer(cfg: ModelConfig) -> dict[str, Any] | None:
    return dict(GPT2_TOKENIZER_META) if cfg.vocab_size == GPT2_VOCAB_SIZE else None


def load(source: str, *, which: str = "latest", seed: int = 0, block_size: int | None = None) -> Weights:
    """Weights from `source` (see the module docstring).

    `which` picks a run's latest or best checkpoint; `seed` initializes a preset; `block_size` crops a
    Hugging Face model's position table to at most that many positions (fine-tuning on short contexts is
    much cheaper).
    """
    kind, _, arg = source.partition(":")
    if kind == "workdir" and arg:
        if not Path(arg).is_dir():
            raise UserError(f"{arg} does not exist: train a model there first (python train.py --config ... "
                            f"--config.workdir={arg}) or pass the right work directory")
        ckpt, step, meta = open_checkpoint(arg, which, "train first (python train.py --config ... "
                                           f"--config.workdir={arg}) or pass the right work directory")
        try:
            params = ckpt.restore_params(step)
        finally:
            ckpt.close()
        return Weights(params, model_config_from_dict(meta["model"]), meta.get("tokenizer"), meta,
                       f"{Path(arg).name} ({which}, step {step})")
    if kind == "hf" and arg:
        from jaxgpt.hf import load_hf_gpt2, read_hf_config

        n_positions = read_hf_config(arg).get("n_positions", 1024)
        crop = {} if block_size is None else {"block_size": min(block_size, n_positions)}
        params, cfg = load_hf_gpt2(arg, **crop)
        return Weights(params, cfg, _vocabulary_tokenizer(cfg), {}, Path(arg).name)
    if kind == "preset" and arg:
        cfg = get_preset(arg)
        return Weights(init_params(cfg, jax.random.key(seed)), cfg, _vocabulary_tokenizer(cfg), {},
                       f"{arg} (random init, seed {seed})")
    raise UserError(f"weights source {source!r} is not understood: use {SOURCES}")


def load_for(source: str, cfg: ModelConfig) -> Weights:
    """Weights from `source` to start training `cfg` from (fine-tuning): the architecture must agree.

    Settings that change neither parameter shapes nor their meaning (dropout, dtypes, attention path,
    scan, remat, init) may differ; scanned and listed layers are converted. A classifier's head is dropped.
    """
    weights = load(source, block_size=cfg.block_size if source.startswith("hf:") else None)
    want, have = cfg.to_dict(), weights.model.to_dict()
    diff = sorted(k for k in want if k not in RUNTIME_FIELDS and want[k] != have[k])
    if diff:
        shown = ", ".join(f"{k}: run {want[k]!r} vs weights {have[k]!r}" for k in diff)
        raise UserError(f"init_from {source} has a different architecture ({shown}): set these model keys to "
                        "the weights' values")
    params = {k: v for k, v in weights.params.items() if k != "cls_head"}
    if weights.model.scan_layers != cfg.scan_layers:
        params = stack_layers(params, cfg.n_layer) if cfg.scan_layers else unstack_layers(params, cfg.n_layer)
    return dataclasses.replace(weights, params=params, model=cfg)
