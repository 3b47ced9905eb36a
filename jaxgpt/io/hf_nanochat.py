"""NanoChat (transformers' `NanoChatForCausalLM`) as a jaxgpt ModelConfig and parameter tree, both ways.

NanoChat is a fixed set of jaxgpt's options (the `nanochat-d12` preset): rotary positions and no position table,
a parameter-free RMSNorm after the embedding, before each sub-layer and at the end, the same RMSNorm on each
head's queries and keys after the rotary, no biases anywhere, logits soft-capped. What it leaves open is what
its config.json holds: the sizes, grouped-query heads (num_key_value_heads), the rotary base, the activation
(hidden_act: relu2 in nanochat, any of jaxgpt's four), the epsilon of every norm, the soft-cap (or none) and a
tied or untied head. A jaxgpt config that NanoChat cannot hold is refused by `export_problems`, one reason each.

The one difference in arithmetic is the rotary's direction: transformers' NanoChat (as nanochat itself) rotates
each pair (x_i, x_{i+D/2}) by minus the angle jaxgpt uses (`layers.rotary`, Llama's convention). Negating the
second half of every query and key head in both computes the same: it turns one rotation into the other, and
the attention scores are unchanged because q.k is a sum over the same products, and the parameter-free QK-norm
ignores signs. So the export negates those rows of q_proj and k_proj (and the import negates them back): still
an exact conversion.

Tensors are torch Linear weights, (out, in): q_proj (H D, C), k_proj and v_proj (K D, C), o_proj (C, H D),
mlp.fc1 (F, C), mlp.fc2 (C, F), under `model.` (the embedding `model.embed_tokens`), and `lm_head` (V, C) when
untied. jaxgpt fuses q, k, v into (C, 3, H, D) `qkv` with as many key/value heads as query heads, and keys
with values into (C, 2, K, D) `kv` beside a (C, H, D) `q` with fewer (grouped-query attention).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxgpt.errors import UserError
from jaxgpt.io.hf_tensors import TensorSpec, config_int, config_number, qkv_places
from jaxgpt.model.config import OPEN_WEIGHT_KNOBS, ModelConfig

MODEL_TYPE = "nanochat"
ARCHITECTURE = "NanoChatForCausalLM"
# transformers' names of jaxgpt's activations (NanoChatMLP looks hidden_act up in ACT2FN).
ACTIVATIONS = {"relu2": "relu2", "relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
HF_ACTIVATIONS = {**{hf: ours for ours, hf in ACTIVATIONS.items()}, "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}
# NanoChatConfig's defaults, for keys a config.json leaves out.
DEFAULTS = {"vocab_size": 50304, "hidden_size": 768, "intermediate_size": 8192, "num_hidden_layers": 12,
            "num_attention_heads": 6, "max_position_embeddings": 2048, "hidden_act": "relu2", "rms_norm_eps": 1e-6,
            "final_logit_softcapping": 15.0, "tie_word_embeddings": False, "rope_theta": 10000.0}


def _int(hf: Mapping[str, Any], key: str, where: str) -> int:
    return config_int(hf, key, where, DEFAULTS.get(key))  # NanoChat's defaults where config.json is silent


def _rope_theta(hf: Mapping[str, Any], where: str) -> float:
    """The rotary base: transformers 5 keeps it in rope_parameters, transformers 4 as rope_theta. Scaled
    variants (linear, dynamic, YaRN...) stretch positions in ways jaxgpt does not implement."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
        raise UserError(f"{where}: rotary scaling {rope!r} has no jaxgpt equivalent (only rope_type 'default')")
    return config_number("rope_theta", rope.get("rope_theta", hf.get("rope_theta", DEFAULTS["rope_theta"])), where)


def config_fields(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The ModelConfig fields of a NanoChat config.json dict."""
    if hf.get("attention_bias", False):
        raise UserError(f"{where}: attention_bias=true: jaxgpt's biases come with every projection and norm "
                        "(use_bias), not with attention's alone")
    activation = hf.get("hidden_act", DEFAULTS["hidden_act"])
    if activation not in HF_ACTIVATIONS:
        raise UserError(f"{where}: hidden_act={activation!r} has no jaxgpt equivalent "
                        f"(supported: {sorted(HF_ACTIVATIONS)})")
    n_embd, n_head = _int(hf, "hidden_size", where), _int(hf, "num_attention_heads", where)
    softcap = hf.get("final_logit_softcapping", DEFAULTS["final_logit_softcapping"])
    return dict(
        vocab_size=_int(hf, "vocab_size", where), block_size=_int(hf, "max_position_embeddings", where),
        n_layer=_int(hf, "num_hidden_layers", where), n_head=n_head, n_embd=n_embd,
        head_dim=_int(hf, "head_dim", where) if hf.get("head_dim") is not None else n_embd // n_head,
        d_ff=_int(hf, "intermediate_size", where),
        n_kv_head=_int(hf, "num_key_value_heads", where) if hf.get("num_key_value_heads") is not None else n_head,
        position="none", rope_theta=_rope_theta(hf, where), norm_placement="pre", final_norm=True, norm="rmsnorm",
        norm_scale=False,
        norm_eps=config_number("rms_norm_eps", hf.get("rms_norm_eps", DEFAULTS["rms_norm_eps"]), where),
        embd_norm=True, qk_norm=True, activation=HF_ACTIVATIONS[activation], use_bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", DEFAULTS["tie_word_embeddings"])),
        logit_softcap=None if softcap is None else config_number("final_logit_softcapping", softcap, where),
        attn_dropout=float(hf.get("attention_dropout") or 0.0))


def export_problems(cfg: ModelConfig) -> list[str]:
    """Why NanoChat's architecture cannot hold a model of this config (empty when it can)."""
    checks = [
        (cfg.rotary, "rope_theta=None (NanoChat's positions are rotary: set rope_theta)"),
        (cfg.position == "none", f"position={cfg.position!r} (NanoChat has no position embeddings)"),
        (cfg.norm == "rmsnorm", f"norm={cfg.norm!r} (NanoChat uses RMSNorm)"),
        (not cfg.norm_scale, "norm_scale=True (NanoChat's RMSNorms have no learned scale)"),
        (cfg.norm_placement == "pre", f"norm_placement={cfg.norm_placement!r} (NanoChat is pre-norm)"),
        (cfg.final_norm, "final_norm=False (NanoChat has a final RMSNorm)"),
        (cfg.embd_norm, "embd_norm=False (NanoChat normalizes the embedding)"),
        (cfg.qk_norm, "qk_norm=False (NanoChat normalizes queries and keys)"),
        (not cfg.use_bias, "use_bias=True (NanoChat has no biases)"),
        (not cfg.pad_positions, "pad_positions=True (NanoChat has no position table)"),
        (not cfg.scale_embeddings, "scale_embeddings=True (NanoChat does not scale embeddings)"),
        (cfg.pad_id is None, f"pad_id={cfg.pad_id} (NanoChat does not mask padding tokens by id)"),
        (not cfg.has_qkv_bias, f"qkv_bias={cfg.qkv_bias} (NanoChat has no biases)"),
        *[(False, f"{change} (NanoChat has no such option)") for change in cfg.changed(OPEN_WEIGHT_KNOBS)],
    ]
    return [message for ok, message in checks if not ok]


def hf_config(cfg: ModelConfig, eot_token: int | None) -> dict[str, Any]:
    """A config.json dict that makes `NanoChatForCausalLM` compute what jaxgpt computes for `cfg` (one with no
    `export_problems`). The special ids are written even when None: NanoChatConfig's defaults (bos 0, eos and
    pad 1) would otherwise name ordinary tokens of the vocabulary."""
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.block_size, "hidden_size": cfg.n_embd,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.d_ff, "hidden_act": ACTIVATIONS[cfg.activation],
        "rms_norm_eps": cfg.norm_eps, "final_logit_softcapping": cfg.logit_softcap, "attention_bias": False,
        "attention_dropout": cfg.attn_dropout, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope, "rope_theta": rope["rope_theta"],  # transformers 5's key, and 4's
        "initializer_range": 0.02, "bos_token_id": eot_token, "eos_token_id": eot_token, "pad_token_id": eot_token,
        "torch_dtype": "float32",
    }


def _attention_specs(prefix: str, layer: str, cfg: ModelConfig) -> list[TensorSpec]:
    """q_proj, k_proj, v_proj at their `qkv_places`; queries and keys with their second halves negated (the
    rotary's direction)."""
    D, C = cfg.head_dim, cfg.n_embd
    return [TensorSpec(f"{prefix}self_attn.{name}_proj.weight", (layer, "attn", kernel, "kernel"),
                       (heads * D, C), (C, heads, D), transpose=True, part=part, flip_half=name != "v")
            for name, (kernel, part, heads) in qkv_places(cfg).items()]


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of a NanoChatForCausalLM of this config, in HF's order."""
    V, C, H, D, F = cfg.vocab_size, cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.d_ff
    specs = [TensorSpec("model.embed_tokens.weight", ("wte", "embedding"), (V, C), (V, C))]
    for i in range(cfg.n_layer):
        prefix, layer = f"model.layers.{i}.", f"h_{i}"
        specs += [
            *_attention_specs(prefix, layer, cfg),
            TensorSpec(prefix + "self_attn.o_proj.weight", (layer, "attn", "out", "kernel"), (C, H * D), (H, D, C),
                       transpose=True),
            TensorSpec(prefix + "mlp.fc1.weight", (layer, "mlp", "fc", "kernel"), (F, C), (C, F), transpose=True),
            TensorSpec(prefix + "mlp.fc2.weight", (layer, "mlp", "proj", "kernel"), (C, F), (F, C), transpose=True),
        ]
    if not cfg.tie_embeddings:
        specs.append(TensorSpec("lm_head.weight", ("lm_head", "kernel"), (V, C), (C, V), transpose=True))
    return specs
