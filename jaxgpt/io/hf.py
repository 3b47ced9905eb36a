"""GPT-2 weights in and out in the Hugging Face `transformers` layout.

A `save_pretrained` directory holds `config.json` plus `model.safetensors` (or the older
`pytorch_model.bin`, possibly sharded with an `*.index.json`). GPT-2 there differs from jaxgpt only
in how the same numbers are arranged:

* HF's `Conv1D` stores weights as (in, out) -- the same orientation as a Flax kernel, so no transpose;
* the fused `c_attn` (C, 3C) splits its columns into q | k | v, each head-major: a plain reshape to
  our (C, 3, H, D) kernel; `attn.c_proj` (C, C) reads rows head-major: a reshape to (H, D, C);
* LayerNorm `weight` is our `scale`; the LM head is tied to `wte` (no `lm_head.weight` tensor).

Every conversion is therefore a reshape, which is why the round trip is exact. Reading safetensors
needs only numpy; the pickle-based `pytorch_model.bin` needs torch. Checkpoints may name tensors
`transformer.h.0...` (GPT2LMHeadModel) or `h.0...` (GPT2Model and the original OpenAI upload).

The command line is `jaxgpt hf inspect PATH` / `jaxgpt hf export --workdir DIR --out PATH`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.errors import UserError, optional_import
from jaxgpt.model.config import RUNTIME_FIELDS, ModelConfig

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS_FILE, SAFETENSORS_INDEX, TORCH_FILE, TORCH_INDEX)

# HF activation names -> ours. GPT-2 itself uses "gelu_new" (the tanh approximation).
HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                  "gelu": "gelu", "relu": "relu"}
OUR_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


# ---------------------------------------------------------------------------------------------------
# Configs


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """config.json of a HF checkpoint directory, checked to describe a GPT-2 model."""
    root = Path(path)
    if not root.exists():
        raise UserError(f"{root} does not exist: pass a Hugging Face GPT-2 checkpoint directory")
    if not root.is_dir():
        raise UserError(f"{root} is a file, not a Hugging Face checkpoint directory (with config.json and "
                        f"{SAFETENSORS_FILE} or {TORCH_FILE})")
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise UserError(f"{root} is not a Hugging Face GPT-2 checkpoint: it has no {CONFIG_FILE}")
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {config_path}: {e}") from None
    if not isinstance(hf, dict):
        raise UserError(f"{config_path} is not a JSON object")
    _check_gpt2_architecture(hf, config_path)
    return hf


def _check_gpt2_architecture(hf: Mapping[str, Any], where: Path) -> None:
    """Refuse other model families early: their tensors might even partly match GPT-2 names."""
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if model_type is not None and model_type != "gpt2":
        raise UserError(f"{where} describes a {model_type!r} model (model_type), not GPT-2: "
                        "only GPT-2 checkpoints can be loaded")
    foreign = [a for a in architectures if not str(a).startswith("GPT2")]
    if foreign:
        raise UserError(f"{where} describes a {foreign[0]} model (architectures), not GPT-2: "
                        "only GPT-2 checkpoints can be loaded")
    if model_type is None and not architectures:
        raise UserError(f"{where} names neither model_type nor architectures: cannot tell it is a GPT-2 checkpoint")


def _hf_int(hf: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{where}: {key}={value!r} must be a positive integer")
    return value


def hf_config_to_model_config(hf: Mapping[str, Any], where: str = CONFIG_FILE, **overrides: Any) -> ModelConfig:
    """The jaxgpt ModelConfig of a GPT-2 config.json dict (+ `overrides` of `config.RUNTIME_FIELDS`).

    Options with which `transformers` computes something jaxgpt does not (cross-attention, unscaled or
    layer-scaled attention) are refused rather than silently mis-loaded.
    """
    unknown = sorted(set(overrides) - RUNTIME_FIELDS)
    if unknown:
        raise UserError(f"cannot override {unknown} when loading GPT-2 weights (they are fixed by {where}); "
                        f"only {sorted(RUNTIME_FIELDS)} may be changed")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in HF_ACTIVATIONS:
        raise UserError(f"{where}: activation_function={activation!r} has no jaxgpt equivalent "
                        f"(supported: {sorted(HF_ACTIVATIONS)})")
    unsupported = {"add_cross_attention": (True,), "scale_attn_weights": (False,),
                   "scale_attn_by_inverse_layer_idx": (True,)}
    for key, bad_values in unsupported.items():
        if hf.get(key) in bad_values:
            raise UserError(f"{where}: {key}={hf[key]} changes GPT-2's attention in a way jaxgpt does not implement")
    n_embd = _hf_int(hf, "n_embd", where, 768)
    n_head = _hf_int(hf, "n_head", where, 12)
    if n_embd % n_head:
        raise UserError(f"{where}: n_embd={n_embd} is not divisible by n_head={n_head}")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    if not isinstance(eps, int | float) or eps <= 0:
        raise UserError(f"{where}: layer_norm_epsilon={eps!r} must be a positive number")
    dropouts = {ours: float(hf.get(theirs, 0.1) or 0.0)
                for ours, theirs in (("embd_dropout", "embd_pdrop"), ("attn_dropout", "attn_pdrop"),
                                     ("resid_dropout", "resid_pdrop"))}
    fields: dict[str, Any] = dict(
        vocab_size=_hf_int(hf, "vocab_size", where, 50257), block_size=_hf_int(hf, "n_positions", where, 1024),
        n_layer=_hf_int(hf, "n_layer", where, 12), n_head=n_head, n_embd=n_embd,
        d_ff=None if hf.get("n_inner") is None else _hf_int(hf, "n_inner", where),  # None: ModelConfig's rule
        position="learned", norm_placement="pre", final_norm=True, norm="layernorm", norm_eps=float(eps),
        activation=HF_ACTIVATIONS[activation], use_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), init="gpt2", **dropouts)
    return ModelConfig(**{**fields, **overrides})


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
        (cfg.head_dim * cfg.n_head == cfg.n_embd,
         f"head_dim*n_head={cfg.head_dim}*{cfg.n_head} != n_embd={cfg.n_embd} (GPT-2 splits n_embd into heads)"),
    ]
    return [message for ok, message in checks if not ok]


def model_config_to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A config.json dict that makes `GPT2LMHeadModel` compute what jaxgpt computes for `cfg`."""
    problems = gpt2_export_problems(cfg)
    if problems:
        raise UserError("this model cannot be exported as GPT-2: " + "; ".join(problems))
    gpt2_vocab = cfg.vocab_size >= 50257  # GPT-2's <|endoftext|> id only exists in its vocabulary
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
        "n_inner": None if cfg.is_derived("d_ff") else cfg.d_ff,  # None: GPT-2's 4 * n_embd, the same rule
        "activation_function": OUR_ACTIVATIONS[cfg.activation], "layer_norm_epsilon": cfg.norm_eps,
        "embd_pdrop": cfg.embd_dropout, "attn_pdrop": cfg.attn_dropout, "resid_pdrop": cfg.resid_dropout,
        "initializer_range": 0.02, "scale_attn_weights": True, "tie_word_embeddings": True,
        "bos_token_id": 50256 if gpt2_vocab else None, "eos_token_id": 50256 if gpt2_vocab else None,
        "torch_dtype": "float32",
    }


# ---------------------------------------------------------------------------------------------------
# The tensor mapping


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One HF tensor and where it lives in jaxgpt's (unscanned) parameter tree."""

    hf_name: str  # without the "transformer." prefix
    path: tuple[str, ...]
    hf_shape: tuple[int, ...]
    our_shape: tuple[int, ...]
    transpose: bool = False  # only the untied lm_head: (V, C) in torch's Linear, (C, V) as a Flax kernel

    def to_ours(self, array: np.ndarray) -> np.ndarray:
        return array.T.reshape(self.our_shape) if self.transpose else array.reshape(self.our_shape)

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        return array.reshape(self.our_shape).T if self.transpose else array.reshape(self.hf_shape)


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of a GPT-2 model of this config, in HF's order."""
    V, P, C, H, D, F = cfg.vocab_size, cfg.block_size, cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.d_ff
    specs = [TensorSpec("wte.weight", ("wte", "embedding"), (V, C), (V, C)),
             TensorSpec("wpe.weight", ("wpe", "embedding"), (P, C), (P, C))]
    for i in range(cfg.n_layer):
        h, layer = f"h.{i}.", f"h_{i}"
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
    specs += [TensorSpec("ln_f.weight", ("ln_f", "scale"), (C,), (C,)),
              TensorSpec("ln_f.bias", ("ln_f", "bias"), (C,), (C,))]
    if not cfg.tie_embeddings:  # lm_head sits outside "transformer." in GPT2LMHeadModel
        specs.append(TensorSpec("lm_head.weight", ("lm_head", "kernel"), (V, C), (C, V), transpose=True))
    return specs


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


# ---------------------------------------------------------------------------------------------------
# Reading tensors


class TensorReader:
    """Names and lazily read arrays of a checkpoint's weight files (one tensor in memory at a time)."""

    def __init__(self, names: Mapping[str, str], read: Callable[[str, str], np.ndarray]) -> None:
        self.file_of = dict(names)  # tensor name -> file holding it
        self._read = read

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self.file_of)

    def get(self, name: str) -> np.ndarray:
        return self._read(self.file_of[name], name)


def _weight_map(root: Path, index_name: str, single_name: str) -> dict[str, str] | None:
    """tensor -> file for a sharded checkpoint's index, or None when the single file is used."""
    if (root / single_name).is_file():
        return None
    try:
        index = json.loads((root / index_name).read_text())
        weight_map = dict(index["weight_map"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read {root / index_name}: {e}") from None
    missing = sorted({f for f in weight_map.values() if not (root / f).is_file()})
    if missing:
        raise UserError(f"{root / index_name} lists shard {missing[0]}, which is not in {root}")
    return weight_map


def _safetensors_reader(root: Path) -> TensorReader:
    safe_open = optional_import("safetensors", f"reading {root / SAFETENSORS_FILE}").safe_open

    weight_map = _weight_map(root, SAFETENSORS_INDEX, SAFETENSORS_FILE)
    files = sorted(set(weight_map.values())) if weight_map else [SAFETENSORS_FILE]
    handles = {}
    names: dict[str, str] = {}
    for file in files:
        try:
            handles[file] = safe_open(str(root / file), framework="numpy")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise UserError(f"cannot read {root / file}: {e}") from None
        names.update({name: file for name in handles[file].keys()})  # noqa: SIM118 (safe_open is no dict)
    def read(file: str, name: str) -> np.ndarray:
        try:
            return handles[file].get_tensor(name)
        except TypeError:  # numpy has no bfloat16: safetensors' numpy API refuses such tensors
            return read_bfloat16_tensor(root / file, name)

    return TensorReader(names, read)


def read_bfloat16_tensor(file: Path, name: str) -> np.ndarray:
    """A bfloat16 tensor of a safetensors file as float32 (exact: bf16 is the top half of an f32).

    The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
    data_offsets}}, then the raw bytes, so the tensor can be read without torch.
    """
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(header_len))[name]
        if entry["dtype"] != "BF16":
            raise UserError(f"{file}: tensor {name!r} has dtype {entry['dtype']}, which cannot be read")
        start, end = entry["data_offsets"]
        f.seek(8 + header_len + start)
        raw = np.frombuffer(f.read(end - start), dtype="<u2")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


def _torch_reader(root: Path) -> TensorReader:
    torch = optional_import("torch", f"reading {root}'s {TORCH_FILE}-style weights (they need torch to read)",
                            otherwise=f"convert the checkpoint to {SAFETENSORS_FILE}")
    weight_map = _weight_map(root, TORCH_INDEX, TORCH_FILE)
    files = sorted(set(weight_map.values())) if weight_map else [TORCH_FILE]
    state: dict[str, Any] = {}
    for file in files:
        try:
            state.update(torch.load(root / file, map_location="cpu", weights_only=True))
        except Exception as e:  # torch raises many types for corrupt or non-zip files
            raise UserError(f"cannot read {root / file}: {e}") from None
    return TensorReader({name: TORCH_FILE for name in state},
                        lambda _file, name: state[name].detach().to(torch.float32).numpy())


def open_hf_tensors(path: str | os.PathLike[str]) -> TensorReader:
    """The tensors of a checkpoint directory: safetensors when present (no torch needed), else torch's pickle."""
    root = Path(path)
    if (root / SAFETENSORS_FILE).is_file() or (root / SAFETENSORS_INDEX).is_file():
        return _safetensors_reader(root)
    if (root / TORCH_FILE).is_file() or (root / TORCH_INDEX).is_file():
        return _torch_reader(root)
    raise UserError(f"{root} is not a Hugging Face GPT-2 checkpoint: it has {CONFIG_FILE} but no weights "
                    f"({SAFETENSORS_FILE} or {TORCH_FILE})")


def _hf_prefix(tensors: TensorReader) -> str:
    """"transformer." for GPT2LMHeadModel-style files, "" for GPT2Model / the original OpenAI upload."""
    return "transformer." if "transformer.wte.weight" in tensors else ""


def hf_tensors_to_params(tensors: TensorReader, cfg: ModelConfig, where: str = "checkpoint") -> dict:
    """jaxgpt's unscanned parameter tree (numpy, cfg.param_dtype) from a checkpoint's tensors."""
    prefix = _hf_prefix(tensors)
    dtype = np.dtype(jnp.dtype(cfg.param_dtype))
    params: dict = {}
    for spec in tensor_specs(cfg):
        name = spec.hf_name if spec.hf_name.startswith("lm_head.") else prefix + spec.hf_name
        if name not in tensors:
            raise UserError(f"{where} is missing tensor {name!r} (expected shape {spec.hf_shape} from config.json)")
        array = tensors.get(name)
        if tuple(array.shape) != spec.hf_shape:
            raise UserError(f"{where}: tensor {name!r} has shape {tuple(array.shape)}, but config.json implies "
                            f"{spec.hf_shape}")
        _set(params, spec.path, np.ascontiguousarray(spec.to_ours(array)).astype(dtype, copy=False))
    if not cfg.tie_embeddings:  # GPT-2's separate head has no bias; jaxgpt's has one: zero computes the same
        params["lm_head"]["bias"] = np.zeros(cfg.vocab_size, dtype)
    return params


def load_hf_gpt2(path: str | os.PathLike[str], **overrides: Any) -> tuple[dict, ModelConfig]:
    """(params, ModelConfig) of a Hugging Face GPT-2 checkpoint directory.

    The params are GPT's tree (stacked under `h` when `scan_layers=True` is passed), so they also
    initialize a GPTClassifier, whose tree adds only `cls_head`. `overrides` may set `config.RUNTIME_FIELDS`
    (dtype, dropout, attention_impl, scan_layers, remat, init), and `block_size` up to
    n_positions (the position table is cropped: fine-tuning on short contexts is much cheaper).
    Other sizes come from config.json.
    """
    root = Path(path)
    hf = read_hf_config(root)
    block_size = overrides.pop("block_size", None)
    cfg = hf_config_to_model_config(hf, where=str(root / CONFIG_FILE), **overrides)
    tensors = open_hf_tensors(root)
    params = hf_tensors_to_params(tensors, cfg, where=str(root))
    if block_size is not None and block_size != cfg.block_size:
        if not isinstance(block_size, int) or not 1 <= block_size <= cfg.block_size:
            raise UserError(f"block_size={block_size!r} must be an integer in 1..{cfg.block_size} "
                            f"(the checkpoint's n_positions)")
        params["wpe"]["embedding"] = params["wpe"]["embedding"][:block_size]  # shorter context: fewer rows
        cfg = cfg.replace(block_size=block_size)
    params = jax.tree.map(jnp.asarray, params)
    if cfg.scan_layers:
        from jaxgpt.model.gpt import stack_layers

        params = stack_layers(params, cfg.n_layer)
    return params, cfg


# ---------------------------------------------------------------------------------------------------
# Writing


def params_to_hf_tensors(params: Mapping, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF-named float32 numpy tensors (GPT2LMHeadModel names, tied head omitted as save_pretrained does)."""
    if "h" in params and "h_0" not in params:
        from jaxgpt.model.gpt import unstack_layers

        params = unstack_layers(dict(params), cfg.n_layer)
    out = {}
    for spec in tensor_specs(cfg):
        try:
            array = np.asarray(_get(params, spec.path), dtype=np.float32)
        except KeyError:
            raise UserError(f"params have no {'/'.join(spec.path)}: they do not belong to this config") from None
        if array.shape != spec.our_shape:
            raise UserError(f"param {'/'.join(spec.path)} has shape {array.shape}, the config implies "
                            f"{spec.our_shape}")
        out["transformer." + spec.hf_name] = np.ascontiguousarray(spec.to_hf(array))
    return out


def save_hf_gpt2(params: Mapping, cfg: ModelConfig, path: str | os.PathLike[str], overwrite: bool = False) -> Path:
    """Write config.json + model.safetensors that `GPT2LMHeadModel.from_pretrained(path)` loads.

    Refuses configs GPT-2 cannot express (the logits would silently differ). A classifier's `cls_head`
    is not part of GPT-2 and is left out. An existing non-empty directory is only written into with
    `overwrite=True`, and then its old weight files are removed so that no stale shard shadows the new one.
    """
    save_file = optional_import("safetensors.numpy", "exporting to Hugging Face").save_file
    hf_config = model_config_to_hf_config(cfg)
    tensors = params_to_hf_tensors(params, cfg)
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise UserError(f"{root} exists and is a file: choose a directory for the exported checkpoint")
    if root.is_dir() and any(root.iterdir()):
        if not overwrite:
            raise UserError(f"{root} exists and is not empty: choose a new directory or pass overwrite "
                            "(--overwrite) to replace its checkpoint")
        for name in WEIGHT_FILES:
            (root / name).unlink(missing_ok=True)
        for shard in [*root.glob("model-*-of-*.safetensors"), *root.glob("pytorch_model-*-of-*.bin")]:
            shard.unlink()
    root.mkdir(parents=True, exist_ok=True)
    tmp_weights = root / (SAFETENSORS_FILE + ".tmp")
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})  # "pt": transformers expects this tag
    os.replace(tmp_weights, root / SAFETENSORS_FILE)
    (root / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    return root
