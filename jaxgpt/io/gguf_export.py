"""A Llama, Qwen2, Qwen3 or Gemma 3 jaxgpt model as a GGUF file that llama.cpp and transformers' GGUF loader read
(`jaxgpt hf export --format gguf`).

The file is what llama.cpp's converter writes for the family's checkpoint: `general.architecture` (`llama`,
`qwen2`, `qwen3`, `gemma3`), the sizes, rotary base and scaling (linear and yarn as keys, llama3 as llama.cpp's
`rope_freqs` table of each frequency's divisor), norm epsilon, Gemma 3's window, layer kinds, local base and
soft-cap as `ARCH.*` metadata; every tensor under its GGUF name (the inverse of `jaxgpt.io.gguf`'s tables: the
loader's names are the one home of the mapping), with each Llama query and key head's rows permuted back into
llama.cpp's interleaved rotary order (`permute`, the inverse of `gguf.unpermute`), Gemma's norms stored as 1 + w,
and no `output` tensor when the head is tied. What GGUF cannot hold so that llama.cpp and `gguf:` compute the same
(Mistral's window, which llama.cpp's `llama` ignores, another activation, ...) is refused, one line (`_problem`).
Types: F32 (exact), F16 for matrices (norms stay F32, as llama.cpp keeps them), or Q8_0 for matrices whose rows
split into its 32-value blocks (quantized by the `gguf` package; F16 for any other).

A run's `JsonTokenizer` of byte-level BPE becomes `tokenizer.ggml.*` (model "gpt2", the vocabulary by id, the
merges, a type per token, the pre-tokenizer's name from `gguf_tokenizer.PRE_TOKENIZERS`, special ids,
add_bos_token) and the run's chat template `tokenizer.chat_template`; rows past the tokenizer's vocabulary (a
padded embedding) get unused placeholder tokens, since llama.cpp wants one token per row.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.data.tokenizer_json import JsonTokenizer
from jaxgpt.errors import UserError, optional_import
from jaxgpt.io import hf_llama
from jaxgpt.io.gguf import ARCHITECTURES, LAYER_NAMES, ROPE_FREQS, TOP_NAMES
from jaxgpt.io.gguf_tokenizer import CONTROL, PRE_TOKENIZERS, USER_DEFINED
from jaxgpt.io.hf import export_family, params_to_hf
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.layers import rope_frequencies

GGUF_TYPES = ("F32", "F16", "Q8_0")
NORMAL, UNUSED = 1, 5  # llama.cpp's token types for a plain vocabulary entry and a placeholder row
_TOP = {hf: gguf for gguf, hf in TOP_NAMES.items()}
# GGUF architecture of each family jaxgpt writes, and the activation llama.cpp assumes for it (no key names one)
ARCH_OF = {hf_llama.NAMES[kind.model_type]: name for name, kind in ARCHITECTURES.items()}
ACTIVATION = {"llama": "silu", "qwen2": "silu", "qwen3": "silu", "gemma3": "gelu_tanh"}
YARN_DEFAULTED = ("rope_beta_fast", "rope_beta_slow", "rope_attention_factor")  # no GGUF key jaxgpt reads holds them


def gguf_name(hf: str, arch: str = "llama") -> str:
    """llama.cpp's name of a transformers tensor of `arch` (`model.layers.3.self_attn.q_proj.weight` ->
    `blk.3.attn_q.weight`): the inverse of the loader's tables."""
    stem, _, suffix = hf.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    layer = {ours: gguf for gguf, ours in {**LAYER_NAMES, **ARCHITECTURES[arch].layer_names}.items()}
    _, _, index, rest = stem.split(".", 3)  # model.layers.N.rest
    return f"blk.{index}.{layer[rest]}.{suffix}"


def permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Llama q/k order: within each head, row s * D/2 + i goes to 2i + s (`gguf.unpermute` undoes it)."""
    head = rows.shape[0] // n_head
    return rows.reshape(n_head, 2, head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def check_type(gguf_type: str) -> None:
    if gguf_type not in GGUF_TYPES:
        raise UserError(f"--gguf_type={gguf_type} is not a type jaxgpt writes: use one of {', '.join(GGUF_TYPES)}")


def _problem(cfg: ModelConfig, family: str) -> str | None:
    """Why a model of `family` cannot be one GGUF file that llama.cpp and jaxgpt's loader read alike (None: it can)."""
    arch = ARCH_OF.get(family)
    if family == "Mistral":
        return ("its sliding window: GGUF's llama architecture, which llama.cpp writes Mistral as, attends over the "
                "whole context")
    if arch is None:
        return f"jaxgpt writes GGUF for {', '.join(ARCH_OF)} models only"
    if cfg.activation != ACTIVATION[arch]:
        return f"activation={cfg.activation!r}: llama.cpp's {arch} computes {ACTIVATION[arch]!r}"
    if cfg.sliding_window is not None and arch != "gemma3":
        return f"sliding_window={cfg.sliding_window}: llama.cpp's {arch} has no sliding window"
    if cfg.rope_scaling == "llama3" and arch == "gemma3":
        return "llama3 rope scaling: GGUF's frequency table would scale Gemma 3's windowed layers too"
    if cfg.rope_scaling == "yarn" and not _default_yarn(cfg):
        return "yarn with beta_fast, beta_slow or attention_factor of its own (jaxgpt's GGUF loader takes the defaults)"
    scale = (cfg.n_embd // cfg.n_head if cfg.n_layer == 62 else cfg.head_dim) ** -0.5
    if arch == "gemma3" and not math.isclose(cfg.query_scale or cfg.head_dim ** -0.5, scale, rel_tol=1e-9):
        return f"query_scale={cfg.query_scale}: GGUF stores none, and llama.cpp's gemma3 uses {scale:.6g}"
    return None


def _default_yarn(cfg: ModelConfig) -> bool:
    """Whether yarn's rotary is what its GGUF keys (factor, original context) give with every other setting at its
    default, as `gguf:` reads it."""
    as_read = cfg.replace(**{f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in YARN_DEFAULTED})
    (freq, factor), (freq_read, factor_read) = (rope_frequencies(c, windowed=False) for c in (cfg, as_read))
    return factor == factor_read and bool(np.array_equal(freq, freq_read))


def check_exportable(cfg: ModelConfig, gguf_type: str) -> str:
    """The GGUF architecture of the model; one line for what the exporter cannot write."""
    check_type(gguf_type)
    family = export_family(cfg).name
    problem = _problem(cfg, family)
    if problem is not None:
        raise UserError(f"this run's {family} model cannot be written as GGUF ({problem}): export it as a Hugging "
                        "Face directory (--format hf)")
    return ARCH_OF[family]


def _tensor(writer: Any, gguf: Any, name: str, array: np.ndarray, gguf_type: str) -> None:
    array = np.ascontiguousarray(array, np.float32)
    Q = gguf.GGMLQuantizationType
    if gguf_type == "F32" or array.ndim == 1:
        writer.add_tensor(name, array)
    elif gguf_type == "Q8_0" and array.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] == 0:
        writer.add_tensor(name, gguf.quants.quantize(array, Q.Q8_0), raw_dtype=Q.Q8_0)
    else:
        writer.add_tensor(name, array.astype(np.float16))


def _metadata(writer: Any, gguf: Any, cfg: ModelConfig, arch: str) -> None:
    writer.add_block_count(cfg.n_layer)
    writer.add_context_length(cfg.block_size)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_head)
    writer.add_head_count_kv(cfg.n_kv_head)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(float(cfg.norm_eps))
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.rope_scaling in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType[cfg.rope_scaling.upper()])
        writer.add_rope_scaling_factor(float(cfg.rope_factor))
    if cfg.rope_scaling == "yarn":
        writer.add_rope_scaling_orig_ctx_len(cfg.rope_original_positions)
    if arch == "gemma3":  # every layer's kind listed, so that no pattern is assumed
        writer.add_sliding_window(cfg.sliding_window or cfg.block_size)
        writer.add_sliding_window_pattern([kind == hf_llama.SLIDING for kind in hf_llama.layer_types(cfg)])
        writer.add_rope_freq_base_swa(float(cfg.rope_local_theta or cfg.rope_theta))
        if cfg.logit_softcap is not None:
            writer.add_final_logit_softcapping(float(cfg.logit_softcap))


def rope_freqs(cfg: ModelConfig) -> np.ndarray:
    """llama.cpp's `rope_freqs` of a llama3-scaled rotary: each unscaled frequency over its scaled one."""
    scaled, _ = rope_frequencies(cfg, windowed=False)
    plain, _ = rope_frequencies(cfg.replace(rope_scaling=None), windowed=False)
    return (np.asarray(plain, np.float64) / np.asarray(scaled, np.float64)).astype(np.float32)


def _tokenizer(writer: Any, tokenizer: JsonTokenizer, vocab_size: int, template: str | None) -> None:
    """`tokenizer.ggml.*` of a byte-level BPE tokenizer.json; refused (one line) when GGUF cannot name it."""
    spec = json.loads(tokenizer.json_text)
    model = spec.get("model") or {}
    pre = next((name for name, value in PRE_TOKENIZERS.items() if value == spec.get("pre_tokenizer")), None)
    if model.get("type") != "BPE" or pre is None:
        raise UserError("the run's tokenizer.json is not a byte-level BPE with a pre-tokenizer GGUF names "
                        f"(known: {', '.join(PRE_TOKENIZERS)}): export it as a Hugging Face directory (--format hf)")
    tokens = {i: token for token, i in model["vocab"].items()}
    types = dict.fromkeys(tokens, NORMAL)
    for added in spec.get("added_tokens") or []:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    if max(tokens) >= vocab_size:
        raise UserError(f"the run's tokenizer has ids up to {max(tokens)}, past the model's {vocab_size} rows")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([tokens.get(i, f"[PAD{i}]") for i in range(vocab_size)])
    writer.add_token_types([types.get(i, UNUSED) for i in range(vocab_size)])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])])
    ids = {token: i for i, token in tokens.items()}
    if tokenizer.bos_token is not None:
        writer.add_bos_token_id(tokenizer.bos_token)
    if tokenizer.eot_token is not None:
        writer.add_eos_token_id(tokenizer.eot_token)
    for name, add in (("unk_token", writer.add_unk_token_id), ("pad_token", writer.add_pad_token_id)):
        if tokenizer.tokens.get(name) in ids:
            add(ids[tokenizer.tokens[name]])
    writer.add_add_bos_token(tokenizer.add_bos)
    if template is not None:
        writer.add_chat_template(template)


def save_gguf(params: Mapping, cfg: ModelConfig, path: str | os.PathLike[str], gguf_type: str = "F32",
              tokenizer: JsonTokenizer | None = None, chat_template: str | None = None, name: str = "jaxgpt") -> Path:
    """Write a Llama, Qwen2, Qwen3 or Gemma 3 model (and its byte-level BPE tokenizer and chat template) as one GGUF
    file, as llama.cpp's converter writes the family: Llama's q/k rows permuted, Gemma's norms stored as 1 + w."""
    gguf = optional_import("gguf", "GGUF export")
    arch = check_exportable(cfg, gguf_type)
    kind = ARCHITECTURES[arch]
    tensors = params_to_hf(params, cfg)
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                          "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type])
    _metadata(writer, gguf, cfg, arch)
    if tokenizer is not None:
        _tokenizer(writer, tokenizer, cfg.vocab_size, chat_template)
    if cfg.rope_scaling == "llama3":
        writer.add_tensor(ROPE_FREQS, rope_freqs(cfg))
    heads = {".self_attn.q_proj.": cfg.n_head, ".self_attn.k_proj.": cfg.n_kv_head}
    for hf, array in tensors.items():
        n = next((n for part, n in heads.items() if part in hf), None) if kind.interleaved_qk else None
        if kind.norm_shift and hf.endswith("norm.weight"):
            array = array + np.float32(kind.norm_shift)
        _tensor(writer, gguf, gguf_name(hf, arch), array if n is None else permute(array, n), gguf_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
