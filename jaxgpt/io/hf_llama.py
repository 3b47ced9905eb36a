"""Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (text) as jaxgpt ModelConfigs and parameter trees, both ways.

The five are one architecture with a few switches, each a ModelConfig field: rotary positions (with `linear`,
`llama3` or `yarn` scaling), RMSNorm before each sub-layer and at the end, grouped-query attention and a gated
feed-forward (SwiGLU; Gemma: GeGLU with tanh GELU). What each family adds:

| family | model_type | adds |
|---|---|---|
| Llama | llama | nothing (LlamaForCausalLM) |
| Mistral | mistral | a sliding window on every layer (sliding_window) |
| Qwen2 | qwen2 | biases on q, k and v (qkv_bias); a window on every layer or none (use_sliding_window) |
| Qwen3 | qwen3 | an RMSNorm per query and key head before the rotary (qk_norm, qk_norm_site="before_rope") |
| Gemma 3 | gemma3_text | (1 + w) norms, a norm after each sub-layer too, embeddings times sqrt(C), a final soft-cap, |
| | | a query scale of its own, windowed layers with every N-th global and a rotary base of their own |

transformers' rotary is jaxgpt's (`layers.rotary`: the pair (i, i + D/2) of each head, rotated by the same
angle in the same direction), so no row of q or k is permuted. Tensors are torch Linear weights (out, in):
q_proj (H D, C) is our (C, H, D) `q`, or slot 0 of the fused (C, 3, H, D) `qkv` when every query head has its own
key/value head; k_proj and v_proj (K D, C) the slots of `kv` (C, 2, K, D) (or `qkv`'s slots 1 and 2); o_proj
(C, H D) our `out` (H, D, C); gate_proj and up_proj (F, C) the gated MLP's `gate` and `fc`, down_proj (C, F) its
`proj`; every norm weight a `scale` (Gemma stores w of (1 + w): so does jaxgpt, `norm_scale_offset`=1).

config.json is read in both of transformers' spellings: 5.x's `rope_parameters` (for Gemma 3 one per layer type,
{"full_attention": ..., "sliding_attention": ...}) and the `rope_theta` / `rope_scaling` / `rope_local_base_freq`
keys of older checkpoints. What jaxgpt cannot compute is refused, one line naming it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from jaxgpt.errors import UserError
from jaxgpt.io.hf_tensors import TensorSpec, config_int, config_number, qkv_places
from jaxgpt.model.config import ModelConfig

# transformers' activation names (hidden_act, Gemma's hidden_activation) -> ours; the MLP is always gated.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu": "gelu"}
OUR_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}
SCALINGS = ("default", "linear", "llama3", "yarn")  # rope_type values jaxgpt computes
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer types


@dataclasses.dataclass(frozen=True)
class Traits:
    """What one family's config.json and tensors hold beyond Llama's."""

    model_type: str
    architecture: str
    theta: float  # the rotary base when config.json gives none
    windows: str  # "none", "all" (Mistral: sliding_window on every layer), "switch" (Qwen: use_sliding_window),
    # "pattern" (Gemma: layer_types / sliding_window_pattern)
    qkv_bias: bool = False  # Qwen2: q/k/v biases always, no other
    qk_norm: bool = False  # Qwen3, Gemma 3
    gemma: bool = False  # (1 + w) norms, sandwich norms, embedding scale, query scale, soft-caps
    tie: bool = False  # tie_word_embeddings' default


LLAMA = Traits("llama", "LlamaForCausalLM", 10000.0, "none")
MISTRAL = Traits("mistral", "MistralForCausalLM", 10000.0, "all")
QWEN2 = Traits("qwen2", "Qwen2ForCausalLM", 10000.0, "switch", qkv_bias=True)
QWEN3 = Traits("qwen3", "Qwen3ForCausalLM", 10000.0, "switch", qk_norm=True)
GEMMA3 = Traits("gemma3_text", "Gemma3ForCausalLM", 1_000_000.0, "pattern", qk_norm=True, gemma=True, tie=True)
# Gemma3TextConfig's defaults of what the Hub's multimodal gemma3 config.json files leave out of their text_config
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                        "max_position_embeddings": 131072, "query_pre_attn_scalar": 256, "sliding_window": 4096}
GEMMA_LOCAL_THETA = 10000.0  # Gemma 3's sliding layers' base when config.json gives none
GEMMA_PATTERN = 6  # sliding_window_pattern's default: every 6th layer global






# ---------------------------------------------------------------------------------------------------
# config.json -> ModelConfig


def _rope_dicts(hf: Mapping[str, Any], traits: Traits) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global layers' rotary parameters, sliding layers'), each with its rope_theta, from either spelling.

    transformers takes `rope_scaling` over `rope_parameters` when a config.json has both (for Gemma 3 it
    scales the global layers only), and a top-level `rope_theta` / `rope_local_base_freq` where the dict has none.
    """
    params = hf.get("rope_parameters") or {}
    nested = isinstance(params, dict) and (FULL in params or SLIDING in params)
    full = dict(params.get(FULL) or {}) if nested else dict(params)
    local = dict(params.get(SLIDING) or {}) if nested else {}
    if isinstance(hf.get("rope_scaling"), dict):
        full = {**full, **hf["rope_scaling"]}
    full.setdefault("rope_theta", hf.get("rope_theta") or traits.theta)
    if traits.gemma:
        local.setdefault("rope_theta", hf.get("rope_local_base_freq") or GEMMA_LOCAL_THETA)
    return full, local


def _rope_fields(hf: Mapping[str, Any], traits: Traits, where: str) -> dict[str, Any]:
    """The rotary fields: base, scaling and its parameters (transformers' defaults where config.json has none)."""
    full, local = _rope_dicts(hf, traits)
    kinds = {name: d.get("rope_type", d.get("type", "default")) for name, d in (("", full), ("sliding ", local))}
    for name, kind in kinds.items():
        if kind not in SCALINGS or (name and kind != "default"):
            allowed = "'default'" if name else ", ".join(map(repr, SCALINGS))
            raise UserError(f"{where}: the {name}layers' rope_type {kind!r} has no jaxgpt equivalent "
                            f"(supported: {allowed})")
    if full.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError(f"{where}: partial_rotary_factor={full['partial_rotary_factor']} (rotary on part of each "
                        "head) has no jaxgpt equivalent: jaxgpt rotates whole heads")
    fields: dict[str, Any] = {"rope_theta": config_number("rope_theta", full["rope_theta"], where)}
    if traits.gemma:
        fields["rope_local_theta"] = config_number("rope_local_base_freq", local["rope_theta"], where)
    kind = kinds[""]
    if kind == "default":
        return fields
    fields.update(rope_scaling=kind, rope_factor=config_number("factor", full.get("factor"), where))
    if kind == "linear":
        return fields
    original = hf.get("original_max_position_embeddings") or full.get("original_max_position_embeddings")
    fields["rope_original_positions"] = config_int({"o": original}, "o", where, hf.get("max_position_embeddings"))
    if kind == "llama3":
        return {**fields, "rope_low_freq_factor": config_number("low_freq_factor", full.get("low_freq_factor"), where),
                "rope_high_freq_factor": config_number("high_freq_factor", full.get("high_freq_factor"), where)}
    if full.get("truncate", True) is not True:
        raise UserError(f"{where}: yarn with truncate=false has no jaxgpt equivalent (its correction range is "
                        "rounded to whole dimensions)")
    factor, attention = fields["rope_factor"], full.get("attention_factor")
    if attention is None:  # transformers' rule: 0.1 ln(factor) + 1, or a ratio of two such with mscale
        mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
        mscales = full.get("mscale"), full.get("mscale_all_dim")
        attention = mscale(mscales[0]) / mscale(mscales[1]) if all(mscales) else mscale(1.0)
    return {**fields, "rope_beta_fast": float(full.get("beta_fast") or 32.0),
            "rope_beta_slow": float(full.get("beta_slow") or 1.0),
            "rope_attention_factor": config_number("attention_factor", attention, where)}


def _sliding_layers(hf: Mapping[str, Any], traits: Traits, n_layer: int, where: str) -> list[bool]:
    """Which layers attend through the sliding window, as transformers decides it for the family."""
    if isinstance(hf.get("layer_types"), list) and traits.windows != "none":
        types = hf["layer_types"]
        if len(types) != n_layer or set(types) - {FULL, SLIDING}:
            raise UserError(f"{where}: layer_types must list {n_layer} entries, each {FULL!r} or {SLIDING!r}")
        return [t == SLIDING for t in types]
    if traits.windows == "all":
        return [hf.get("sliding_window") is not None] * n_layer
    if traits.windows == "switch":
        first = hf.get("max_window_layers", 28) if hf.get("use_sliding_window") else n_layer
        return [i >= first for i in range(n_layer)]
    if traits.windows == "pattern":
        every = config_int(hf, "sliding_window_pattern", where, GEMMA_PATTERN)
        return [(i + 1) % every != 0 for i in range(n_layer)]
    return [False] * n_layer


def _window_fields(hf: Mapping[str, Any], traits: Traits, n_layer: int, where: str) -> dict[str, Any]:
    """sliding_window and window_pattern: every layer windowed, or all but every N-th (N = window_pattern)."""
    sliding = _sliding_layers(hf, traits, n_layer, where)
    if not any(sliding):
        return {}
    window = config_int(hf, "sliding_window", where)
    if all(sliding):
        return {"sliding_window": window}
    every = sliding.index(False) + 1
    if sliding != [(i + 1) % every != 0 for i in range(n_layer)]:
        raise UserError(f"{where}: windowed layers {[i for i, s in enumerate(sliding) if s]} have no jaxgpt "
                        "equivalent: jaxgpt windows every layer, or every layer but each N-th (window_pattern)")
    return {"sliding_window": window, "window_pattern": every}


def _refuse_unsupported(hf: Mapping[str, Any], traits: Traits, where: str) -> None:
    checks = {"mlp_bias": "biases in the feed-forward", "use_bidirectional_attention": "bidirectional attention",
              "attention_bias": "a bias on o_proj" if traits.qkv_bias else "biases on q, k, v and o_proj"}
    for key, what in checks.items():
        if hf.get(key):
            raise UserError(f"{where}: {key}=true ({what}) is not something jaxgpt's {traits.model_type} loader "
                            "computes")


def config_fields(traits: Traits) -> Callable[[Mapping[str, Any], str], dict[str, Any]]:
    """The `Family.fields` of one family: config.json -> ModelConfig fields."""

    def fields(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
        _refuse_unsupported(hf, traits, where)
        activation = hf.get("hidden_activation") or hf.get("hidden_act") or (
            "gelu_pytorch_tanh" if traits.gemma else "silu")
        if activation not in ACTIVATIONS:
            raise UserError(f"{where}: hidden_act={activation!r} has no jaxgpt equivalent "
                            f"(supported: {sorted(ACTIVATIONS)})")
        n_embd, n_head, n_layer = (config_int(hf, k, where) for k in ("hidden_size", "num_attention_heads",
                                                                "num_hidden_layers"))
        head_dim = config_int(hf, "head_dim", where, n_embd // n_head)
        out = dict(
            vocab_size=config_int(hf, "vocab_size", where), block_size=config_int(hf, "max_position_embeddings", where),
            n_layer=n_layer, n_head=n_head, n_embd=n_embd, head_dim=head_dim,
            d_ff=config_int(hf, "intermediate_size", where),
            n_kv_head=config_int(hf, "num_key_value_heads", where, n_head),
            position="none", norm_placement="pre", final_norm=True, norm="rmsnorm", norm_scale=True,
            norm_eps=config_number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6), where), use_bias=False,
            activation=ACTIVATIONS[activation], gated_mlp=True,
            tie_embeddings=bool(hf.get("tie_word_embeddings", traits.tie)),
            attn_dropout=float(hf.get("attention_dropout") or 0.0),
            **_rope_fields(hf, traits, where), **_window_fields(hf, traits, n_layer, where))
        if "sliding_window" not in out:
            out.pop("rope_local_theta", None)  # (Gemma 3 with no windowed layer: a base no layer uses)
        if traits.qkv_bias:
            out["qkv_bias"] = True
        if traits.qk_norm:
            out.update(qk_norm=True, qk_norm_site="before_rope")
        if traits.gemma:
            if hf.get("attn_logit_softcapping") is not None:  # (Gemma 2's; Gemma 3's checkpoints have null)
                raise UserError(f"{where}: attn_logit_softcapping={hf['attn_logit_softcapping']}: transformers' "
                                "Gemma3 attention ignores it, so no logits would agree; set it to null")
            cap = hf.get("final_logit_softcapping")
            scalar = config_number("query_pre_attn_scalar", hf.get("query_pre_attn_scalar", head_dim), where)
            out.update(norm_scale_offset=1.0, sandwich_norm=True, scale_embeddings=True, query_scale=scalar ** -0.5,
                       logit_softcap=None if cap is None else config_number("final_logit_softcapping", cap, where))
        return out

    return fields


# ---------------------------------------------------------------------------------------------------
# ModelConfig -> config.json


def export_problems(traits: Traits) -> Callable[[ModelConfig], list[str]]:
    """The `Family.problems` of one family: why it cannot hold a config (empty when it can)."""

    def problems(cfg: ModelConfig) -> list[str]:
        name = traits.architecture
        qkv_bias = cfg.use_bias if cfg.qkv_bias is None else cfg.qkv_bias
        gemma = traits.gemma
        checks = [
            (cfg.rotary, f"rope_theta=None ({name}'s positions are rotary)"),
            (cfg.position == "none", f"position={cfg.position!r} ({name} has no position embeddings)"),
            (cfg.norm == "rmsnorm" and cfg.norm_scale, f"norm={cfg.norm!r}, norm_scale={cfg.norm_scale} ({name} "
             "uses RMSNorm with a learned scale)"),
            (cfg.norm_placement == "pre" and cfg.final_norm, f"{name} is pre-norm with a final norm"),
            (not cfg.embd_norm, f"embd_norm=True ({name} does not normalize the embedding)"),
            (not cfg.use_bias, f"use_bias=True ({name}'s norms and projections have no biases)"),
            (qkv_bias == traits.qkv_bias, f"qkv_bias={qkv_bias} ({name} has {'' if traits.qkv_bias else 'no '}"
             "q/k/v biases)"),
            (cfg.gated_mlp and cfg.activation in OUR_ACTIVATIONS, f"gated_mlp={cfg.gated_mlp}, activation="
             f"{cfg.activation!r} ({name}'s feed-forward is gated: silu, gelu or gelu_tanh)"),
            (cfg.qk_norm == traits.qk_norm, f"qk_norm={cfg.qk_norm} ({name} has {'' if traits.qk_norm else 'no '}"
             "QK-norm)"),
            (not cfg.qk_norm or cfg.qk_norm_site == "before_rope",
             f"qk_norm_site={cfg.qk_norm_site!r} ({name} normalizes queries and keys before the rotary)"),
            (not cfg.pad_positions and cfg.pad_id is None, f"pad_positions or pad_id ({name} has neither)"),
            (cfg.norm_scale_offset == (1.0 if gemma else 0.0), f"norm_scale_offset={cfg.norm_scale_offset}"),
            (cfg.sandwich_norm == gemma, f"sandwich_norm={cfg.sandwich_norm}"),
            (cfg.scale_embeddings == gemma, f"scale_embeddings={cfg.scale_embeddings}"),
            (cfg.attn_softcap is None, f"attn_softcap={cfg.attn_softcap} ({name} soft-caps no attention scores)"),
            (gemma or (cfg.logit_softcap is None and cfg.query_scale is None),
             f"logit_softcap or query_scale set ({name} has neither)"),
            (gemma or cfg.rope_local_theta is None, f"rope_local_theta={cfg.rope_local_theta} ({name} has one base)"),
            (not gemma or cfg.sliding_window is None or cfg.rope_scaling is None or cfg.rope_local_theta is not None,
             f"rope_scaling on windowed layers ({name} scales its global layers only: set rope_local_theta)"),
            (cfg.sliding_window is None or traits.windows != "none", f"sliding_window ({name} has none)"),
            (cfg.window_pattern is None or traits.windows == "pattern",
             f"window_pattern={cfg.window_pattern} ({name} windows all layers or none)"),
        ]
        if gemma and cfg.query_scale is not None:
            scalar = round(cfg.query_scale ** -2)
            checks.append((scalar ** -0.5 == cfg.query_scale, f"query_scale={cfg.query_scale} is not 1/sqrt of an "
                           "integer (Gemma's query_pre_attn_scalar)"))
        return [message for ok, message in checks if not ok]

    return problems


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """transformers 5's rope_parameters of the global layers."""
    rope: dict[str, Any] = {"rope_type": cfg.rope_scaling or "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling is not None:
        rope["factor"] = cfg.rope_factor
    if cfg.rope_scaling in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = cfg.rope_original_positions
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    if cfg.rope_scaling == "yarn":
        rope.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow,
                    attention_factor=cfg.rope_attention_factor)
    return rope


def layer_types(cfg: ModelConfig) -> list[str]:
    """transformers' kind of each layer: windowed (sliding_attention) or not (full_attention)."""
    return [SLIDING if cfg.sliding_window is not None and (cfg.window_pattern is None or (i + 1) % cfg.window_pattern)
            else FULL for i in range(cfg.n_layer)]


def hf_config(traits: Traits) -> Callable[[ModelConfig, int | None], dict[str, Any]]:
    """The `Family.hf_config` of one family: a config.json that makes transformers compute what jaxgpt computes
    for `cfg`. Rotary settings are written in both spellings (5.x's rope_parameters, 4.x's rope_theta and
    rope_scaling); the special ids are the tokenizer's (`save_generation_config` writes where a sample ends)."""

    def config(cfg: ModelConfig, eot_token: int | None) -> dict[str, Any]:
        rope = _rope_parameters(cfg)
        out: dict[str, Any] = {
            "architectures": [traits.architecture], "model_type": traits.model_type,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.block_size, "hidden_size": cfg.n_embd,
            "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.d_ff, "rms_norm_eps": cfg.norm_eps,
            ("hidden_activation" if traits.gemma else "hidden_act"): OUR_ACTIVATIONS[cfg.activation],
            "attention_dropout": cfg.attn_dropout, "tie_word_embeddings": cfg.tie_embeddings,
            "rope_theta": rope["rope_theta"], "initializer_range": 0.02, "torch_dtype": "float32",
            "bos_token_id": eot_token, "eos_token_id": eot_token, "pad_token_id": None,
        }
        if cfg.rope_scaling is not None:
            out["rope_scaling"] = rope
        if traits.model_type in ("llama", "qwen3"):
            out["attention_bias"] = False
        if traits.model_type == "llama":
            out["mlp_bias"] = False
        if traits.windows != "none":
            out["sliding_window"] = cfg.sliding_window
        if traits.windows == "switch":
            out.update(use_sliding_window=cfg.sliding_window is not None, max_window_layers=0)
        if traits.gemma:
            local = {"rope_type": "default", "rope_theta": float(cfg.rope_local_theta or cfg.rope_theta)}
            out.update(rope_parameters={FULL: rope, SLIDING: local}, rope_local_base_freq=local["rope_theta"],
                       layer_types=layer_types(cfg), sliding_window=cfg.sliding_window or cfg.block_size,
                       query_pre_attn_scalar=cfg.head_dim if cfg.query_scale is None else round(cfg.query_scale ** -2),
                       attn_logit_softcapping=None, final_logit_softcapping=cfg.logit_softcap)
            if cfg.window_pattern is not None:
                out["sliding_window_pattern"] = cfg.window_pattern
        else:
            out["rope_parameters"] = rope
        return out

    return config


# ---------------------------------------------------------------------------------------------------
# Tensors


def _attention_specs(prefix: str, layer: str, cfg: ModelConfig, bias: bool) -> list[TensorSpec]:
    """q_proj, k_proj, v_proj (and their biases) at their `qkv_places`."""
    D, C = cfg.head_dim, cfg.n_embd
    specs = []
    for name, (kernel, part, heads) in qkv_places(cfg).items():
        hf = f"{prefix}self_attn.{name}_proj."
        specs.append(TensorSpec(hf + "weight", (layer, "attn", kernel, "kernel"), (heads * D, C),
                                (C, heads, D), transpose=True, part=part))
        if bias:
            specs.append(TensorSpec(hf + "bias", (layer, "attn", kernel, "bias"), (heads * D,),
                                    (heads, D), part=part))
    return specs


def tensor_specs(traits: Traits) -> Callable[[ModelConfig], list[TensorSpec]]:
    """The `Family.tensor_specs` of one family: every tensor of its *ForCausalLM for a config, in HF's order."""

    def specs_of(cfg: ModelConfig) -> list[TensorSpec]:
        V, C, H, D, F = cfg.vocab_size, cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.d_ff
        norm = lambda hf, *path: TensorSpec(hf + ".weight", (*path, "scale"), (C,), (C,))
        # Llama's post_attention_layernorm is the norm before the feed-forward; Gemma's comes after attention
        norms = ({"input_layernorm": "ln_1", "post_attention_layernorm": "ln_1_post",
                  "pre_feedforward_layernorm": "ln_2", "post_feedforward_layernorm": "ln_2_post"} if traits.gemma
                 else {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2"})
        specs = [TensorSpec("model.embed_tokens.weight", ("wte", "embedding"), (V, C), (V, C))]
        for i in range(cfg.n_layer):
            prefix, layer = f"model.layers.{i}.", f"h_{i}"
            specs += _attention_specs(prefix, layer, cfg, traits.qkv_bias)
            specs.append(TensorSpec(prefix + "self_attn.o_proj.weight", (layer, "attn", "out", "kernel"),
                                    (C, H * D), (H, D, C), transpose=True))
            if traits.qk_norm:
                specs += [TensorSpec(f"{prefix}self_attn.{n}.weight", (layer, "attn", n, "scale"), (D,), (D,))
                          for n in ("q_norm", "k_norm")]
            specs += [TensorSpec(f"{prefix}mlp.{hf}_proj.weight", (layer, "mlp", ours, "kernel"), shape, shape[::-1],
                                 transpose=True)
                      for hf, ours, shape in (("gate", "gate", (F, C)), ("up", "fc", (F, C)), ("down", "proj", (C, F)))]
            specs += [norm(prefix + hf, layer, ours) for hf, ours in norms.items()]
        specs.append(norm("model.norm", "ln_f"))
        if not cfg.tie_embeddings:
            specs.append(TensorSpec("lm_head.weight", ("lm_head", "kernel"), (V, C), (C, V), transpose=True))
        return specs

    return specs_of


FAMILIES = {traits.model_type: traits for traits in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3)}
NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3_text": "Gemma 3"}
