"""Models in and out of the Hugging Face `transformers` layout: GPT-2, NanoChat, Llama, Mistral, Qwen and Gemma.

A `save_pretrained` directory holds `config.json` plus `model.safetensors` (or the older `pytorch_model.bin`,
possibly sharded with an `*.index.json`). Its `model_type` names the family, a `Family` here: GPT-2
(`GPT2LMHeadModel`, below), NanoChat (`NanoChatForCausalLM`, `jaxgpt.io.hf_nanochat`), or Llama, Mistral, Qwen2,
Qwen3 and Gemma 3 (`jaxgpt.io.hf_llama`; Gemma 3's image-text checkpoints load their language model,
`text_model_config`). Each is a config mapping both ways, the list of configs it cannot
hold, and a list of `hf_tensors.TensorSpec`s; the one loader (`load_hf`) and exporter (`save_hf`) serve all, and a
jaxgpt config is exported as the first family that can hold it (GPT-2 needs LayerNorm, NanoChat parameter-free
RMSNorms, the Llama-like ones a learned scale and a gated feed-forward; among those, each adds what Llama lacks).

GPT-2 there differs from jaxgpt only in how the same numbers are arranged:

* HF's `Conv1D` stores weights as (in, out) -- the same orientation as a Flax kernel, so no transpose;
* the fused `c_attn` (C, 3C) splits its columns into q | k | v, each head-major: a plain reshape to
  our (C, 3, H, D) kernel; `attn.c_proj` (C, C) reads rows head-major: a reshape to (H, D, C);
* LayerNorm `weight` is our `scale`; the LM head is tied to `wte` (no `lm_head.weight` tensor).

Every conversion is therefore a reshape, which is why the round trip is exact. Checkpoints may name tensors
`transformer.h.0...` (GPT2LMHeadModel) or `h.0...` (GPT2Model and the original OpenAI upload).

The command line is `jaxgpt hf inspect PATH` / `jaxgpt hf export --workdir DIR --out PATH`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.errors import UserError
from jaxgpt.io import hf_llama, hf_nanochat
from jaxgpt.io.hf_tensors import (
    CONFIG_FILE,
    TensorReader,
    TensorSpec,
    config_int,
    hf_tensors_to_params,
    open_hf_tensors,
    params_to_hf_tensors,
    write_checkpoint,
)
from jaxgpt.model.config import OPEN_WEIGHT_KNOBS, RUNTIME_FIELDS, ModelConfig

# HF activation names -> ours. GPT-2 itself uses "gelu_new" (the tanh approximation).
HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                  "gelu": "gelu", "relu": "relu"}
OUR_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family of `transformers` that jaxgpt converts both ways."""

    name: str
    class_prefix: str  # of every class of the family in transformers ("GPT2" of GPT2LMHeadModel, GPT2Model)
    base_prefix: str  # what the tensor names of its base model alone (GPT2Model, NanoChatModel) lack
    fields: Callable[[Mapping[str, Any], str], dict[str, Any]]  # config.json -> ModelConfig fields
    hf_config: Callable[[ModelConfig, int | None], dict[str, Any]]  # (config, special id) -> config.json
    problems: Callable[[ModelConfig], list[str]]  # why it cannot hold a config
    tensor_specs: Callable[[ModelConfig], list[TensorSpec]]


# ---------------------------------------------------------------------------------------------------
# Configs


# Image-text models whose language model is a family here: model_type -> (that model's class, its config's defaults)
MULTIMODAL = {"gemma3": (hf_llama.GEMMA3.architecture, hf_llama.GEMMA3_TEXT_DEFAULTS)}
# where their checkpoints keep the language model's tensors: the Hub's files (and transformers 5's saves), 4.5x's
TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.", "language_model.lm_head.":
                 "lm_head."}


def text_model_config(hf: Mapping[str, Any], where: str | os.PathLike[str]) -> dict[str, Any]:
    """The config.json of a multimodal checkpoint's language model (`MULTIMODAL`; Gemma 3's 4B-27B): its
    text_config over the defaults its class fills in (the Hub's files list only what differs), as the family's
    *ForCausalLM, its head tied as the whole model's config says (else as text_config says), its logits uncapped
    as the image-text class computes them."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise UserError(f"{where}: a multimodal {hf['model_type']!r} config.json without a text_config: it names no "
                        "language model to load")
    architecture, defaults = MULTIMODAL[hf["model_type"]]
    # (Gemma3ForConditionalGeneration soft-caps no logits, whatever its text_config says: the Hub's say null)
    out = {**defaults, **text, "architectures": [architecture], "model_type": hf_llama.GEMMA3.model_type,
           "final_logit_softcapping": None}
    if hf.get("tie_word_embeddings") is not None:  # (transformers ties the image-text model's head by this one)
        out["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return out


def language_model_tensors(tensors: TensorReader) -> TensorReader:
    """A checkpoint's tensors with a multimodal model's language-model names (`TEXT_PREFIXES`) made its
    *ForCausalLM's; the image tower's are left as they are (no spec reads them)."""
    renamed = {}
    for name in tensors:
        prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), None)
        renamed[name if prefix is None else TEXT_PREFIXES[prefix] + name.removeprefix(prefix)] = name
    return TensorReader({new: tensors.file_of[old] for new, old in renamed.items()},
                        lambda file, new: tensors.get(renamed[new]))


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """config.json of a HF checkpoint directory, checked to describe a model family jaxgpt converts (a multimodal
    one's language model: `text_model_config`)."""
    root = Path(path)
    if not root.exists():
        raise UserError(f"{root} does not exist: pass a Hugging Face checkpoint directory (GPT-2 or NanoChat)")
    if not root.is_dir():
        raise UserError(f"{root} is a file, not a Hugging Face checkpoint directory (with config.json and "
                        "model.safetensors or pytorch_model.bin)")
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise UserError(f"{root} is not a Hugging Face checkpoint: it has no {CONFIG_FILE}")
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {config_path}: {e}") from None
    if not isinstance(hf, dict):
        raise UserError(f"{config_path} is not a JSON object")
    if hf.get("model_type") in MULTIMODAL:
        hf = text_model_config(hf, config_path)
    hf_family(hf, config_path)
    return hf


def hf_family(hf: Mapping[str, Any], where: str | os.PathLike[str]) -> Family:
    """The family a config.json describes. Others are refused early: their tensors might even partly match."""
    model_type = hf.get("model_type")
    architectures = [str(a) for a in hf.get("architectures") or []]
    known = " and ".join(f.name for f in FAMILIES.values())
    if model_type is None and not architectures:
        raise UserError(f"{where} names neither model_type nor architectures: cannot tell which model it holds")
    if model_type is not None and model_type not in FAMILIES:
        raise UserError(f"{where} describes a {model_type!r} model (model_type): only {known} checkpoints can be "
                        "loaded")
    family = FAMILIES.get(model_type) or next(
        (f for f in FAMILIES.values() if architectures[0].startswith(f.class_prefix)), None)
    foreign = [a for a in architectures if family is None or not a.startswith(family.class_prefix)]
    if family is None or foreign:
        raise UserError(f"{where} describes a {foreign[0]} model (architectures): only {known} checkpoints can be "
                        "loaded")
    return family




def hf_config_to_model_config(hf: Mapping[str, Any], where: str = CONFIG_FILE, **overrides: Any) -> ModelConfig:
    """The jaxgpt ModelConfig of a config.json dict (+ `overrides` of `config.RUNTIME_FIELDS`).

    Options with which `transformers` computes something jaxgpt does not (cross-attention, unscaled or
    layer-scaled attention, attention-only biases, scaled rotary) are refused rather than silently mis-loaded.
    """
    unknown = sorted(set(overrides) - RUNTIME_FIELDS)
    if unknown:
        raise UserError(f"cannot override {unknown} when loading Hugging Face weights (they are fixed by {where}); "
                        f"only {sorted(RUNTIME_FIELDS)} may be changed")
    return ModelConfig(**{**hf_family(hf, where).fields(hf, where), **overrides})


def _gpt2_fields(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The ModelConfig fields of a GPT-2 config.json dict."""
    activation = hf.get("activation_function", "gelu_new")
    if activation not in HF_ACTIVATIONS:
        raise UserError(f"{where}: activation_function={activation!r} has no jaxgpt equivalent "
                        f"(supported: {sorted(HF_ACTIVATIONS)})")
    unsupported = {"add_cross_attention": (True,), "scale_attn_weights": (False,),
                   "scale_attn_by_inverse_layer_idx": (True,)}
    for key, bad_values in unsupported.items():
        if hf.get(key) in bad_values:
            raise UserError(f"{where}: {key}={hf[key]} changes GPT-2's attention in a way jaxgpt does not implement")
    n_embd = config_int(hf, "n_embd", where, 768)
    n_head = config_int(hf, "n_head", where, 12)
    if n_embd % n_head:
        raise UserError(f"{where}: n_embd={n_embd} is not divisible by n_head={n_head}")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    if not isinstance(eps, int | float) or eps <= 0:
        raise UserError(f"{where}: layer_norm_epsilon={eps!r} must be a positive number")
    dropouts = {ours: float(hf.get(theirs, 0.1) or 0.0)
                for ours, theirs in (("embd_dropout", "embd_pdrop"), ("attn_dropout", "attn_pdrop"),
                                     ("resid_dropout", "resid_pdrop"))}
    return dict(
        vocab_size=config_int(hf, "vocab_size", where, 50257), block_size=config_int(hf, "n_positions", where, 1024),
        n_layer=config_int(hf, "n_layer", where, 12), n_head=n_head, n_embd=n_embd,
        d_ff=None if hf.get("n_inner") is None else config_int(hf, "n_inner", where),  # None: ModelConfig's rule
        position="learned", norm_placement="pre", final_norm=True, norm="layernorm", norm_eps=float(eps),
        activation=HF_ACTIVATIONS[activation], use_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), init="gpt2", **dropouts)


def gpt2_export_problems(cfg: ModelConfig) -> list[str]:
    """Why GPT-2's architecture cannot hold a model of this config (empty when it can)."""
    checks = [
        (cfg.norm_placement == "pre", f"norm_placement={cfg.norm_placement!r} (GPT-2 is pre-norm)"),
        (cfg.final_norm, "final_norm=False (GPT-2 has a final LayerNorm)"),
        (cfg.norm == "layernorm", f"norm={cfg.norm!r} (GPT-2 uses layernorm)"),
        (cfg.position == "learned", f"position={cfg.position!r} (GPT-2 learns its positions)"),
        (not cfg.pad_positions, "pad_positions=True (GPT-2 starts positions at 0)"),
        (not cfg.scale_embeddings, "scale_embeddings=True (GPT-2 does not scale embeddings)"),
        (cfg.pad_id is None, f"pad_id={cfg.pad_id} (GPT-2 does not mask padding tokens by id)"),
        (cfg.tie_embeddings, "tie_embeddings=False (GPT-2 ties its LM head to wte)"),
        (cfg.use_bias, "use_bias=False (GPT-2 has biases everywhere)"),
        (cfg.activation in OUR_ACTIVATIONS, f"activation={cfg.activation!r}"),
        (cfg.norm_scale, "norm_scale=False (GPT-2's LayerNorms have a scale)"),
        (cfg.n_kv_head == cfg.n_head, f"n_kv_head={cfg.n_kv_head} (GPT-2 has a key/value head per query head)"),
        *[(not getattr(cfg, name), f"{name}={getattr(cfg, name)!r} (GPT-2 has no such option)")
          for name in ("rope_theta", "qk_norm", "embd_norm", "logit_softcap")],
        *[(False, f"{change} (GPT-2 has no such option)") for change in cfg.changed(OPEN_WEIGHT_KNOBS)],
        (cfg.has_qkv_bias == cfg.use_bias, f"qkv_bias={cfg.qkv_bias} (GPT-2's q/k/v biases are its other biases')"),
        (cfg.head_dim * cfg.n_head == cfg.n_embd,
         f"head_dim*n_head={cfg.head_dim}*{cfg.n_head} != n_embd={cfg.n_embd} (GPT-2 splits n_embd into heads)"),
    ]
    return [message for ok, message in checks if not ok]


def _gpt2_config(cfg: ModelConfig, eot_token: int | None) -> dict[str, Any]:
    """A config.json dict that makes `GPT2LMHeadModel` compute what jaxgpt computes for `cfg`."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
        "n_inner": None if cfg.is_derived("d_ff") else cfg.d_ff,  # None: GPT-2's 4 * n_embd, the same rule
        "activation_function": OUR_ACTIVATIONS[cfg.activation], "layer_norm_epsilon": cfg.norm_eps,
        "embd_pdrop": cfg.embd_dropout, "attn_pdrop": cfg.attn_dropout, "resid_pdrop": cfg.resid_dropout,
        "initializer_range": 0.02, "scale_attn_weights": True, "tie_word_embeddings": True,
        "bos_token_id": eot_token, "eos_token_id": eot_token, "torch_dtype": "float32",
    }


def gpt2_tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of a GPT2LMHeadModel of this config, in HF's order."""
    V, P, C, H, D, F = cfg.vocab_size, cfg.block_size, cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.d_ff
    specs = [TensorSpec("transformer.wte.weight", ("wte", "embedding"), (V, C), (V, C)),
             TensorSpec("transformer.wpe.weight", ("wpe", "embedding"), (P, C), (P, C))]
    for i in range(cfg.n_layer):
        h, layer = f"transformer.h.{i}.", f"h_{i}"
        specs += [
            TensorSpec(h + "ln_1.weight", (layer, "ln_1", "scale"), (C,), (C,)),
            TensorSpec(h + "ln_1.bias", (layer, "ln_1", "bias"), (C,), (C,)),
            TensorSpec(h + "attn.c_attn.weight", (layer, "attn", "qkv", "kernel"), (C, 3 * C), (C, 3, H, D)),
            TensorSpec(h + "attn.c_attn.bias", (layer, "attn", "qkv", "bias"), (3 * C,), (3, H, D)),
            TensorSpec(h + "attn.c_proj.weight", (layer, "attn", "out", "kernel"), (C, C), (H, D, C)),
            TensorSpec(h + "attn.c_proj.bias", (layer, "attn", "out", "bias"), (C,), (C,)),
            TensorSpec(h + "ln_2.weight", (layer, "ln_2", "scale"), (C,), (C,)),
            TensorSpec(h + "ln_2.bias", (layer, "ln_2", "bias"), (C,), (C,)),
            TensorSpec(h + "mlp.c_fc.weight", (layer, "mlp", "fc", "kernel"), (C, F), (C, F)),
            TensorSpec(h + "mlp.c_fc.bias", (layer, "mlp", "fc", "bias"), (F,), (F,)),
            TensorSpec(h + "mlp.c_proj.weight", (layer, "mlp", "proj", "kernel"), (F, C), (F, C)),
            TensorSpec(h + "mlp.c_proj.bias", (layer, "mlp", "proj", "bias"), (C,), (C,)),
        ]
    specs += [TensorSpec("transformer.ln_f.weight", ("ln_f", "scale"), (C,), (C,)),
              TensorSpec("transformer.ln_f.bias", ("ln_f", "bias"), (C,), (C,))]
    if not cfg.tie_embeddings:
        specs.append(TensorSpec("lm_head.weight", ("lm_head", "kernel"), (V, C), (C, V), transpose=True))
    return specs


FAMILIES = {  # by config.json's model_type
    "gpt2": Family("GPT-2", "GPT2", "transformer.", _gpt2_fields, _gpt2_config, gpt2_export_problems,
                   gpt2_tensor_specs),
    hf_nanochat.MODEL_TYPE: Family("NanoChat", "NanoChat", "model.", hf_nanochat.config_fields,
                                   hf_nanochat.hf_config, hf_nanochat.export_problems, hf_nanochat.tensor_specs),
    **{model_type: Family(hf_llama.NAMES[model_type], traits.architecture.removesuffix("ForCausalLM"), "model.",
                          hf_llama.config_fields(traits), hf_llama.hf_config(traits), hf_llama.export_problems(traits),
                          hf_llama.tensor_specs(traits))
       for model_type, traits in hf_llama.FAMILIES.items()},
}


def export_family(cfg: ModelConfig) -> Family:
    """The family that holds a model of this config; a one-line error naming what the closest one lacks."""
    problems = {family: family.problems(cfg) for family in FAMILIES.values()}
    closest = min(problems, key=lambda family: len(problems[family]))
    if problems[closest]:
        raise UserError(f"this model cannot be exported as {closest.name} (nor as any other Hugging Face family "
                        f"jaxgpt writes): " + "; ".join(problems[closest]))
    return closest


def model_config_to_hf_config(cfg: ModelConfig, eot_token: int | None = None) -> dict[str, Any]:
    """The config.json of `cfg`'s family (`export_family`), with the tokenizer's end-of-text id when it has one
    (generation_config.json names the tokens a sample ends at, `hf_tokenizer.save_generation_config`)."""
    return export_family(cfg).hf_config(cfg, eot_token)


# ---------------------------------------------------------------------------------------------------
# Loading and saving


def load_hf(path: str | os.PathLike[str], **overrides: Any) -> tuple[dict, ModelConfig]:
    """(params, ModelConfig) of a Hugging Face checkpoint directory of any family in `FAMILIES`.

    The params are GPT's tree (stacked under `h` when `scan_layers=True` is passed), so they also
    initialize a GPTClassifier, whose tree adds only `cls_head`. `overrides` may set `config.RUNTIME_FIELDS`
    (dtype, dropout, attention_impl, scan_layers, remat, init), and `block_size` up to the checkpoint's
    positions (a learned position table is cropped: fine-tuning on short contexts is much cheaper).
    Other sizes come from config.json.
    """
    root = Path(path)
    hf = read_hf_config(root)
    block_size = overrides.pop("block_size", None)
    cfg = hf_config_to_model_config(hf, where=str(root / CONFIG_FILE), **overrides)
    family = hf_family(hf, root / CONFIG_FILE)
    params = hf_tensors_to_params(language_model_tensors(open_hf_tensors(root)), family.tensor_specs(cfg),
                                  cfg.param_dtype, where=str(root), base_prefix=family.base_prefix)
    if not cfg.tie_embeddings and cfg.use_bias:  # HF's separate heads have no bias; jaxgpt's: zero computes the same
        params["lm_head"]["bias"] = np.zeros(cfg.vocab_size, params["lm_head"]["kernel"].dtype)
    if block_size is not None and block_size != cfg.block_size:
        if not isinstance(block_size, int) or not 1 <= block_size <= cfg.block_size:
            raise UserError(f"block_size={block_size!r} must be an integer in 1..{cfg.block_size} "
                            f"(the checkpoint's positions)")
        if "wpe" in params:
            params["wpe"]["embedding"] = params["wpe"]["embedding"][:block_size]  # shorter context: fewer rows
        cfg = cfg.replace(block_size=block_size)
    params = jax.tree.map(jnp.asarray, params)
    if cfg.scan_layers:
        from jaxgpt.model.gpt import stack_layers

        params = stack_layers(params, cfg.n_layer)
    return params, cfg


def params_to_hf(params: Mapping, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The HF-named float32 tensors of `cfg`'s family (tied head omitted, as save_pretrained does)."""
    if "h" in params and "h_0" not in params:
        from jaxgpt.model.gpt import unstack_layers

        params = unstack_layers(dict(params), cfg.n_layer)
    return params_to_hf_tensors(params, export_family(cfg).tensor_specs(cfg))


def save_hf(params: Mapping, cfg: ModelConfig, path: str | os.PathLike[str], overwrite: bool = False,
            eot_token: int | None = None) -> Path:
    """Write config.json + model.safetensors that `AutoModelForCausalLM.from_pretrained(path)` loads, as the
    family that can hold `cfg` (`export_family`); `eot_token`: the tokenizer's end-of-text id, if it has one.

    Refuses configs no family can express (the logits would silently differ). A classifier's `cls_head`
    is not part of a language model and is left out. An existing non-empty directory is only written into with
    `overwrite=True`, and then its old weight files are removed so that no stale shard shadows the new one.
    """
    hf_config = model_config_to_hf_config(cfg, eot_token)
    tensors = params_to_hf(params, cfg)
    root = Path(path)
    write_checkpoint(root, tensors, hf_config, overwrite)
    return root
